"""Triton scatter of new tokens' K/V into the paged cache by slot mapping.

An fp8 cache (FP8=True) stores each value quantized as kernels/fp8_kv.py says: divided by the
per-tensor scale, saturated to +-448 and rounded to e4m3 by `_round_to_e4m3` before the cast.
"""

import triton
import triton.language as tl

from kernels._validate import FP8_KV_DTYPE, check_store_kv

# Upper bound on elements one program moves: large enough to amortise the
# slot load, small enough to keep register pressure low at head_dim 256.
_MAX_TILE_ELEMS = 4096


FP8_MAX = tl.constexpr(448.0)  # largest finite e4m3fn value


@triton.jit
def _round_to_e4m3(x):
    """fp32 x, |x| <= 448 -> the nearest e4m3 value (ties to even), still fp32.

    The cast to fp8 that follows is then exact. Rounding here rather than in the cast
    because the Triton interpreter's fp32 -> fp8 cast ORs a rounding carry into the exponent
    (31.8 becomes 16, not 32), so the CPU tests would check a different number than a GPU
    (cvt.rn) stores; the few integer ops are free in this memory-bound copy.
    Normal range (|x| >= 2^-6): round the fp32 bit pattern to 3 mantissa bits, the carry
    moving into the exponent as an integer add. Below it e4m3 is subnormal with a fixed step
    2^-9: x * 512 rounded to an integer by the fp32 add/subtract of 1.5 * 2^23.
    """
    bits = x.to(tl.int32, bitcast=True)
    keep = (bits >> 20) & 1  # lowest kept mantissa bit: ties go to the even neighbour
    normal = ((bits + 0x7FFFF + keep) & -0x100000)  # the 20 dropped mantissa bits cleared
    magic = 12582912.0  # 1.5 * 2^23: adding it leaves x * 512 rounded to an integer
    sub = (((x * 512.0 + magic) - magic) * 0.001953125).to(tl.int32, bitcast=True)  # * 2^-9
    # x's sign put back: -0.001 rounds to -0.0 (as torch's cast), not the add's +0.0.
    sub = sub | (bits & -0x80000000)
    return tl.where(tl.abs(x) < 0.015625, sub, normal).to(tl.float32, bitcast=True)


@triton.jit
def _quantize_fp8(x, scale):
    """x / scale saturated and rounded to e4m3 (fp32); div_rn: IEEE division, as torch's."""
    q = tl.div_rn(x.to(tl.float32), scale)
    return _round_to_e4m3(tl.minimum(tl.maximum(q, -FP8_MAX), FP8_MAX))


# num_tokens changes every step: no recompiles for its value being 1 or % 16.
@triton.jit(do_not_specialize=["num_tokens"])
def _store_kv_kernel(
    key_ptr,      # [num_tokens, num_kv_heads, head_dim]  (strided view allowed)
    value_ptr,    # [num_tokens, num_kv_heads, head_dim]  (strided view allowed)
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]  contiguous
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]  contiguous
    slot_ptr,     # [num_tokens]
    k_scale_ptr,  # FP8: [1] fp32 (else unused)
    v_scale_ptr,  # FP8: [1] fp32 (else unused)
    num_tokens,
    num_kv_heads,
    num_slots,    # num_blocks * block_size
    stride_k_tok, stride_k_head, stride_k_dim,
    stride_v_tok, stride_v_head, stride_v_dim,
    stride_c_slot, stride_c_head,  # cache is contiguous: slot stride = kv_heads * head_dim
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,  # next power of two >= HEAD_DIM
    BLOCK_H: tl.constexpr,     # kv heads handled per program (power of two)
    FP8: tl.constexpr,         # the cache is e4m3: quantize with the scales
):
    tok = tl.program_id(0)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    offs_d = tl.arange(0, HEAD_DIM_P)  # [HEAD_DIM_P]

    slot = tl.load(slot_ptr + tok, mask=tok < num_tokens, other=-1).to(tl.int64)
    # Broadcast before comparing: the interpreter mistypes scalar-bool & tensor-bool.
    slot_h = tl.zeros([BLOCK_H], dtype=tl.int64) + slot  # [BLOCK_H]
    # slot < 0 marks padding rows; slots past the cache are dropped rather than
    # written out of bounds (the torch paths raise on them instead).
    row_ok = (slot_h >= 0) & (slot_h < num_slots) & (offs_h < num_kv_heads)  # [BLOCK_H]
    mask = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)  # [BLOCK_H, HEAD_DIM_P]

    tok64 = tok.to(tl.int64)
    src_k = tok64 * stride_k_tok + offs_h[:, None] * stride_k_head + offs_d[None, :] * stride_k_dim
    src_v = tok64 * stride_v_tok + offs_h[:, None] * stride_v_head + offs_d[None, :] * stride_v_dim
    # int64: slot * stride exceeds 2**31 for caches of more than ~2G elements.
    dst = (slot_h[:, None] * stride_c_slot + offs_h[:, None] * stride_c_head
           + offs_d[None, :])  # [BLOCK_H, HEAD_DIM_P]

    k = tl.load(key_ptr + src_k, mask=mask, other=0.0)
    v = tl.load(value_ptr + src_v, mask=mask, other=0.0)
    if FP8:
        k = _quantize_fp8(k, tl.load(k_scale_ptr))
        v = _quantize_fp8(v, tl.load(v_scale_ptr))
    k = k.to(k_cache_ptr.dtype.element_ty)
    v = v.to(v_cache_ptr.dtype.element_ty)
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def _interpreted() -> bool:
    # triton.jit picks the interpreter at decoration time from TRITON_INTERPRET.
    return "Interpret" in type(_store_kv_kernel).__name__


def _check_backend(device) -> None:
    if device.type != "cuda" and not _interpreted():
        raise ValueError(
            f"Triton store_kv needs CUDA tensors, got device {device} (set TRITON_INTERPRET=1 "
            "before importing triton to run it on CPU, or use "
            "kernels.torch_attention.store_kv_torch)"
        )


def store_kv(key, value, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    """Scatter key/value rows into the paged caches; slot < 0 skips the token.

    key, value:       [num_tokens, num_kv_heads, head_dim]  (may be strided views)
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]  contiguous
    slot_mapping:     [num_tokens]  int64 (int32 accepted)
    k_scale, v_scale: [1] fp32, required for (and only for) an fp8 cache: rows are stored as
                      kernels.fp8_kv.quantize_fp8(row, scale)
    """
    check_store_kv(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    _check_backend(key.device)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    head_dim_p = triton.next_power_of_2(head_dim)
    block_h = min(triton.next_power_of_2(num_kv_heads), max(1, _MAX_TILE_ELEMS // head_dim_p))
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    grid = (num_tokens, triton.cdiv(num_kv_heads, block_h))
    fp8 = k_cache.dtype == FP8_KV_DTYPE
    _store_kv_kernel[grid](
        key, value, k_cache, v_cache, slot_mapping,
        k_scale if fp8 else slot_mapping, v_scale if fp8 else slot_mapping,
        num_tokens, num_kv_heads, num_slots,
        key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2),
        k_cache.stride(1), k_cache.stride(2),
        HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p, BLOCK_H=block_h, FP8=fp8,
        num_warps=4 if block_h * head_dim_p >= 1024 else 1,
    )
