"""Triton scatter of new tokens' K/V into the paged cache by slot mapping."""

import triton
import triton.language as tl

from kernels._validate import check_store_kv

# Upper bound on elements one program moves: large enough to amortise the
# slot load, small enough to keep register pressure low at head_dim 256.
_MAX_TILE_ELEMS = 4096


# num_tokens changes every step: no recompiles for its value being 1 or % 16.
@triton.jit(do_not_specialize=["num_tokens"])
def _store_kv_kernel(
    key_ptr,      # [num_tokens, num_kv_heads, head_dim]  (strided view allowed)
    value_ptr,    # [num_tokens, num_kv_heads, head_dim]  (strided view allowed)
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]  contiguous
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]  contiguous
    slot_ptr,     # [num_tokens]
    num_tokens,
    num_kv_heads,
    num_slots,    # num_blocks * block_size
    stride_k_tok, stride_k_head, stride_k_dim,
    stride_v_tok, stride_v_head, stride_v_dim,
    stride_c_slot, stride_c_head,  # cache is contiguous: slot stride = kv_heads * head_dim
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,  # next power of two >= HEAD_DIM
    BLOCK_H: tl.constexpr,     # kv heads handled per program (power of two)
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


def store_kv(key, value, k_cache, v_cache, slot_mapping) -> None:
    """Scatter key/value rows into the paged caches; slot < 0 skips the token.

    key, value:       [num_tokens, num_kv_heads, head_dim]  (may be strided views)
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]  contiguous
    slot_mapping:     [num_tokens]  int64 (int32 accepted)
    """
    check_store_kv(key, value, k_cache, v_cache, slot_mapping)
    _check_backend(key.device)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    head_dim_p = triton.next_power_of_2(head_dim)
    block_h = min(triton.next_power_of_2(num_kv_heads), max(1, _MAX_TILE_ELEMS // head_dim_p))
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    grid = (num_tokens, triton.cdiv(num_kv_heads, block_h))
    _store_kv_kernel[grid](
        key, value, k_cache, v_cache, slot_mapping,
        num_tokens, num_kv_heads, num_slots,
        key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2),
        k_cache.stride(1), k_cache.stride(2),
        HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p, BLOCK_H=block_h,
        num_warps=4 if block_h * head_dim_p >= 1024 else 1,
    )
