"""Group-wise int4 weights times activations: y = x @ W^T, W dequantized tile by tile.

One layout serves AWQ and GPTQ (their layers repack to it at load). For a logical weight
W [N out, K in]:

    qweight [K / 8, N] int32   eight 4-bit codes of consecutive input rows per word, the
                               lowest nibble first: q[k, n] = qweight[k // 8, n] >> 4 * (k % 8) & 15
    scales  [G, N]             one scale per group and output (fp16 / bf16 / fp32)
    zeros   [G, N] uint8       the true zero point (0..16: GPTQ v1's stored zero + 1 reaches 16)
    g_idx   [K] int32          the group of each input row; k // group_size unless GPTQ's
                               act-order permuted the rows (desc_act), so no row reordering is needed

    W[n, k] = (q[k, n] - zeros[g_idx[k], n]) * scales[g_idx[k], n]

The Triton kernel: each program owns a BLOCK_M x BLOCK_N tile of y and walks K in BLOCK_K
steps, unpacking the codes, subtracting the zeros and scaling in fp32 before the dot, which
accumulates in fp32. `int4_gemm_torch` is the same arithmetic in torch, tiled over outputs so the
full dequantized weight never exists at once: the CPU path and the test oracle.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _int4_gemm_kernel(
    x_ptr,        # [M, K] activations (row-major, stride_xm between rows)
    qweight_ptr,  # [K / 8, N] int32 packed codes
    scales_ptr,   # [G, N]
    zeros_ptr,    # [G, N] uint8
    g_idx_ptr,    # [K] int32
    y_ptr,        # [M, N] output, x's dtype
    M, N, K, stride_xm, stride_ym,
    IEEE_DOT: tl.constexpr,   # fp32 activations: exact fp32 products, not TF32
    UPCAST: tl.constexpr,     # half activations computed in fp32 (the interpreter lacks a bf16 dot)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = offs_m < M, offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        a = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        kn_ok = k_ok[:, None] & n_ok[None, :]
        # Each word is read by its 8 rows of the tile (from cache); row k keeps its own nibble.
        words = tl.load(qweight_ptr + (offs_k // 8)[:, None].to(tl.int64) * N + offs_n[None, :],
                        mask=kn_ok, other=0)  # [BLOCK_K, BLOCK_N]
        q = (words >> ((offs_k % 8) * 4)[:, None]) & 0xF
        group = tl.load(g_idx_ptr + offs_k, mask=k_ok, other=0).to(tl.int64)
        gn = group[:, None] * N + offs_n[None, :]
        s = tl.load(scales_ptr + gn, mask=kn_ok, other=0.0).to(tl.float32)
        z = tl.load(zeros_ptr + gn, mask=kn_ok, other=0).to(tl.int32)
        w = (q - z).to(tl.float32) * s  # [BLOCK_K, BLOCK_N] = W^T tile; 0 where masked
        if IEEE_DOT:
            acc = tl.dot(a, w, acc, input_precision="ieee")
        elif UPCAST:
            acc = tl.dot(a.to(tl.float32), w, acc)
        else:
            acc = tl.dot(a, w.to(a.dtype), acc)
    y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _interpreted() -> bool:
    # triton.jit picks the interpreter at decoration time from TRITON_INTERPRET.
    return "Interpret" in type(_int4_gemm_kernel).__name__


def check_int4_gemm(x, qweight, scales, zeros, g_idx) -> None:
    """ValueError naming the argument whose dtype, shape or device does not fit the layout."""
    named = dict(x=(x, 2, FLOAT_DTYPES), qweight=(qweight, 2, (torch.int32,)), scales=(scales, 2, FLOAT_DTYPES),
                 zeros=(zeros, 2, (torch.uint8,)), g_idx=(g_idx, 1, (torch.int32,)))
    for name, (t, ndim, dtypes) in named.items():
        if not isinstance(t, torch.Tensor) or t.dim() != ndim or t.dtype not in dtypes:
            got = f"{t.dtype} of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a {ndim}-D tensor of {', '.join(map(str, dtypes))}; got {got}")
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}")
    k, n = x.shape[1], qweight.shape[1]
    if qweight.shape[0] * 8 != k:
        raise ValueError(f"qweight has {qweight.shape[0]} packed rows for x's {k} input features (expected {k} / 8)")
    if scales.shape != zeros.shape or scales.shape[1] != n:
        raise ValueError(f"scales {tuple(scales.shape)} and zeros {tuple(zeros.shape)} must both be [groups, {n}]")
    if g_idx.shape[0] != k:
        raise ValueError(f"g_idx has {g_idx.shape[0]} entries for {k} input features")
    if x.stride(1) != 1 or not (qweight.is_contiguous() and scales.is_contiguous() and zeros.is_contiguous()):
        raise ValueError("x's rows and qweight, scales, zeros must be contiguous")


def int4_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
              g_idx: torch.Tensor, block: tuple[int, int, int] = (32, 64, 64)) -> torch.Tensor:
    """x [M, K] @ W^T -> [M, N] in x's dtype (Triton; CUDA, or the interpreter on CPU)."""
    check_int4_gemm(x, qweight, scales, zeros, g_idx)
    if x.device.type != "cuda" and not _interpreted():
        raise ValueError(f"Triton int4_gemm needs CUDA tensors, got device {x.device} (set TRITON_INTERPRET=1 "
                         "before importing triton to run it on CPU, or use int4_gemm_torch)")
    (m, k), n = x.shape, qweight.shape[1]
    y = x.new_empty(m, n)
    if m == 0:
        return y
    block_m, block_n, block_k = block
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _int4_gemm_kernel[grid](x, qweight, scales, zeros, g_idx, y, m, n, k, x.stride(0), y.stride(0),
                            IEEE_DOT=x.dtype == torch.float32, UPCAST=_interpreted(),
                            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return y


def unpack_int4_rows(qweight: torch.Tensor) -> torch.Tensor:
    """[K / 8, N] int32 -> [K, N] int32 codes 0..15 (row k from nibble k % 8 of word row k // 8)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=qweight.device)
    return ((qweight[:, None, :] >> shifts[None, :, None]) & 0xF).reshape(-1, qweight.shape[1])


def int4_gemm_torch(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                    g_idx: torch.Tensor, tile_n: int = 256) -> torch.Tensor:
    """The reference and CPU path: per tile of `tile_n` outputs, dequantize W^T [K, tile_n] in fp32
    (exact: a 4-bit code times an fp16 scale), cast to x's dtype and multiply. x [M, K] -> [M, N]."""
    check_int4_gemm(x, qweight, scales, zeros, g_idx)
    n = qweight.shape[1]
    g = g_idx.long()
    out = []
    for n0 in range(0, n, tile_n):
        cols = slice(n0, min(n0 + tile_n, n))
        q = unpack_int4_rows(qweight[:, cols])  # [K, tile]
        z, s = zeros[:, cols].index_select(0, g), scales[:, cols].index_select(0, g)
        out.append(x @ ((q - z.int()).float() * s.float()).to(x.dtype))
    return torch.cat(out, dim=1) if len(out) > 1 else out[0]
