"""y = x @ W.T on the GPU with W kept in GGUF blocks, dequantized inside the tile loop (Triton).

W is uint8 [N, row_bytes], row n the blocks of W[n, :] (layouts: kernels/torch_gguf.py). Each
program owns a [BLOCK_M, BLOCK_N] tile of y and walks K one 32-feature sub-block at a time:

    for each block b of the row (32 features for Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1, 256 for the K-quants):
        for each 32-wide sub-block s of it (static):
            w = dequant(W[n tile, block b], s)          [BLOCK_N, 32] fp32, from bytes in registers
            acc += x[m tile, 32 features] @ w.T          tl.dot, fp32 accumulation

so the weight crosses memory as its quantized bytes only. Every type in torch_gguf.BLOCK_LAYOUTS
has its dequantizer here (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.torch_gguf import (BLOCK_LAYOUTS, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, check_weight,
                                gguf_linear_ref)


@triton.jit
def _f16(ptr, mask):
    """fp16 at byte pointers ptr [BLOCK_N, 1] (little-endian, unaligned) -> fp32."""
    lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _byte(ptr, mask):
    return tl.load(ptr, mask=mask, other=0).to(tl.int32)


@triton.jit
def _dequant_sub(blk, lane, mask, s: tl.constexpr, QTYPE: tl.constexpr):
    """Sub-block s (32 features) of the blocks at blk [BLOCK_N, 1] -> [BLOCK_N, 32] fp32.
    lane [1, 32] is the feature within the sub-block."""
    if QTYPE == 8:  # Q8_0: d | int8 q[32]
        q = tl.load(blk + 2 + lane, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        w = _f16(blk, mask) * q
    elif QTYPE == 2 or QTYPE == 3 or QTYPE == 6 or QTYPE == 7:
        # Q4_0 / Q4_1 / Q5_0 / Q5_1: d | (m: Q4_1, Q5_1) | (qh[4]: Q5_0, Q5_1) | qs[16]; feature l is
        # the low (l < 16) or high nibble of qs[l % 16], its 5th bit bit l % 8 of qh[l // 8]
        HAS_MIN: tl.constexpr = QTYPE == 3 or QTYPE == 7
        FIVE_BIT: tl.constexpr = QTYPE == 6 or QTYPE == 7
        QS: tl.constexpr = 2 + (2 if HAS_MIN else 0) + (4 if FIVE_BIT else 0)
        q = (_byte(blk + QS + lane % 16, mask) >> (lane // 16 * 4)) & 15
        if FIVE_BIT:
            q = q | (((_byte(blk + QS - 4 + lane // 8, mask) >> (lane % 8)) & 1) << 4)
        if HAS_MIN:
            w = _f16(blk, mask) * q.to(tl.float32) + _f16(blk + 2, mask)
        else:
            w = _f16(blk, mask) * (q - (16 if FIVE_BIT else 8)).to(tl.float32)
    elif QTYPE == 14:  # Q6_K: ql[128] | qh[64] | int8 scales[16] | d; s = 4h + t
        h: tl.constexpr = s // 4
        t: tl.constexpr = s % 4
        ql = (_byte(blk + 64 * h + 32 * (t % 2) + lane, mask) >> (4 * (t // 2))) & 15
        qh = (_byte(blk + 128 + 32 * h + lane, mask) >> (2 * t)) & 3
        scale = tl.load(blk + 192 + 8 * h + 2 * t + lane // 16, mask=mask, other=0).to(tl.int8, bitcast=True)
        w = _f16(blk + 208, mask) * scale.to(tl.float32) * ((ql | (qh << 4)) - 32).to(tl.float32)
    else:  # Q4_K / Q5_K: d | dmin | scales[12] | (qh[32]) | qs[128]; 6-bit scale and min of sub-block s
        if s < 4:
            sc = _byte(blk + 4 + s, mask) & 63
            mn = _byte(blk + 8 + s, mask) & 63
        else:
            sc = (_byte(blk + 8 + s, mask) & 15) | ((_byte(blk + s, mask) >> 6) << 4)
            mn = (_byte(blk + 8 + s, mask) >> 4) | ((_byte(blk + 4 + s, mask) >> 6) << 4)
        QS: tl.constexpr = 48 if QTYPE == 13 else 16
        q = (_byte(blk + QS + 32 * (s // 2) + lane, mask) >> (4 * (s % 2))) & 15
        if QTYPE == 13:
            q = q | (((_byte(blk + 16 + lane, mask) >> s) & 1) << 4)
        w = _f16(blk, mask) * sc.to(tl.float32) * q.to(tl.float32) - _f16(blk + 2, mask) * mn.to(tl.float32)
    return w


@triton.jit
def _gguf_gemm_kernel(
    x_ptr,  # [M, K] float, rows stride_xm apart
    w_ptr,  # [N, row_bytes] uint8, rows stride_wn apart
    y_ptr,  # [M, N] x's dtype, rows stride_ym apart
    M, N, K, stride_xm, stride_wn, stride_ym,
    QTYPE: tl.constexpr, BLOCK_ELEMS: tl.constexpr, BLOCK_BYTES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE_DOT: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = offs_m < M, offs_n < N
    lane = tl.arange(0, 32)
    rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn  # [BLOCK_N, 1] row starts
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm  # [BLOCK_M, 1]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for b in range(0, K // BLOCK_ELEMS):
        blk = rows + b * BLOCK_BYTES
        for s in tl.static_range(BLOCK_ELEMS // 32):
            w = _dequant_sub(blk, lane[None, :], n_ok[:, None], s, QTYPE)  # [BLOCK_N, 32]
            x = tl.load(x_rows + (b * BLOCK_ELEMS + s * 32) + lane[None, :], mask=m_ok[:, None], other=0.0)
            if IEEE_DOT:
                acc = tl.dot(x.to(tl.float32), tl.trans(w), acc, input_precision="ieee")
            else:  # half-precision x: the tensor cores, fp32 accumulation
                acc = tl.dot(x, tl.trans(w).to(x.dtype), acc)
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def gguf_gemm(x: torch.Tensor, weight: torch.Tensor, qtype: int, block_m: int = 16,
              block_n: int = 64) -> torch.Tensor:
    """x [M, K] (fp32 / fp16 / bf16) @ W.T -> [M, N] in x's dtype; W uint8 [N, row_bytes] on x's device.
    ValueError for a wrong dtype, shape, device or type."""
    if x.dim() != 2 or x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"gguf_gemm takes a 2-D float x, got {x.dtype} {tuple(x.shape)}")
    if x.device != weight.device:
        raise ValueError(f"x is on {x.device} and the GGUF weight on {weight.device}")
    if block_m < 16 or block_n < 16:
        raise ValueError(f"block_m={block_m}, block_n={block_n}: tl.dot needs tiles of at least 16")
    check_weight(weight, qtype, x.shape[1])
    x = x if x.stride(1) == 1 else x.contiguous()
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    (M, K), N = x.shape, weight.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    elems, nbytes = BLOCK_LAYOUTS[qtype]
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    _gguf_gemm_kernel[grid](x, weight, y, M, N, K, x.stride(0), weight.stride(0), y.stride(0),
                            QTYPE=qtype, BLOCK_ELEMS=elems, BLOCK_BYTES=nbytes, BLOCK_M=block_m, BLOCK_N=block_n,
                            IEEE_DOT=x.dtype == torch.float32)
    return y


def gguf_gemm_ref(x: torch.Tensor, weight: torch.Tensor, qtype: int) -> torch.Tensor:
    """The pure-torch oracle: W dequantized a tile of rows at a time, x @ W.T in fp32."""
    return gguf_linear_ref(x, weight, qtype)


def _interpreted() -> bool:
    # triton.jit picks the interpreter at decoration time from TRITON_INTERPRET.
    return "Interpret" in type(_gguf_gemm_kernel).__name__


# The constants are the ggml type ids _dequant_sub branches on (kept literal there: constexpr
# comparisons inside a jit function cannot read module globals that are not constexpr).
assert (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) == (2, 3, 6, 7, 8, 12, 13, 14)
