"""Block-wise FP8 GEMM (the DeepSeek-V3 / Qwen3-FP8 layout) in Triton: y = dequant(a) @ dequant(b).T

    a        [M, K]                         float8_e4m3fn, activations quantized per token per bk columns
    a_scale  [M, ceil(K / bk)]              float32
    b        [N, K]                         float8_e4m3fn, the weight
    b_scale  [ceil(N / bn), ceil(K / bk)]   float32, one scale per bn x bk block of b
    y        [M, N]                         out_dtype

Each program computes one BLOCK_M x BLOCK_N tile of y. Its K loop steps one bk group at a time
(BLOCK_K = bk), so a step's fp8 product has one a-scale per row and one b-scale per column
(column n sits in block row n // bn) and joins the fp32 accumulator scaled by both:

    acc[m, n] += (a[m, g*bk:(g+1)*bk] . b[n, g*bk:(g+1)*bk]) * a_scale[m, g] * b_scale[n // bn, g]

K, M and N need not be multiples of anything: the last group and the edge tiles are masked.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
# A group of zeros gets this scale rather than 0 (x / 0 would be NaN); any positive value works.
MIN_SCALE = 1e-12


@triton.jit
def _fp8_block_gemm_kernel(
    a_ptr,        # [M, K] fp8
    b_ptr,        # [N, K] fp8
    c_ptr,        # [M, N] out dtype
    a_scale_ptr,  # [M, num_groups] fp32
    b_scale_ptr,  # [ceil(N / GROUP_N), num_groups] fp32
    M, N, K, GROUP_N,
    stride_am, stride_ak, stride_bn, stride_bk, stride_cm, stride_cn,
    stride_asm, stride_asg, stride_bsn, stride_bsg,
    UPCAST: tl.constexpr,  # dot in fp32 (the interpreter has no fp8 dot)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :] * stride_ak  # [BLOCK_M, BLOCK_K]
    b_ptrs = b_ptr + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None] * stride_bk  # [BLOCK_K, BLOCK_N]
    a_scale_ptrs = a_scale_ptr + offs_m * stride_asm            # [BLOCK_M]
    b_scale_ptrs = b_scale_ptr + (offs_n // GROUP_N) * stride_bsn  # [BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = offs_k < K - g * BLOCK_K
        a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        a_s = tl.load(a_scale_ptrs + g * stride_asg, mask=m_ok, other=0.0)
        b_s = tl.load(b_scale_ptrs + g * stride_bsg, mask=n_ok, other=0.0)
        if UPCAST:
            part = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            part = tl.dot(a, b)
        acc += part * a_s[:, None] * b_s[None, :]
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _interpreted() -> bool:
    # triton.jit picks the interpreter at decoration time from TRITON_INTERPRET.
    return "Interpret" in type(_fp8_block_gemm_kernel).__name__


def _check_block_size(block_size) -> tuple[int, int]:
    if not (isinstance(block_size, (tuple, list)) and len(block_size) == 2
            and all(isinstance(v, int) and v > 0 for v in block_size)):
        raise ValueError(f"block_size must be [bn, bk] positive ints, got {block_size!r}")
    bn, bk = block_size
    if bk < 16 or bk & (bk - 1):
        raise ValueError(f"block_size bk={bk} must be a power of two >= 16 (it is the kernel's K tile)")
    return bn, bk


def _check_block_operands(a, a_scale, b, b_scale, block_size) -> tuple[int, int]:
    bn, bk = _check_block_size(block_size)
    for name, t, dtype in (("a", a, FP8_DTYPE), ("b", b, FP8_DTYPE), ("a_scale", a_scale, torch.float32),
                           ("b_scale", b_scale, torch.float32)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.dtype != dtype:
            raise ValueError(f"{name} must be a 2-D {dtype} tensor, got "
                             f"{getattr(t, 'dtype', type(t).__name__)} of shape {tuple(getattr(t, 'shape', ()))}")
        if t.device != a.device:
            raise ValueError(f"{name} is on {t.device} but a is on {a.device}")
    (m, k), (n, k_b) = a.shape, b.shape
    if k_b != k:
        raise ValueError(f"a [M, K] = {tuple(a.shape)} and b [N, K] = {tuple(b.shape)} differ in K")
    groups = triton.cdiv(k, bk)
    if tuple(a_scale.shape) != (m, groups):
        raise ValueError(f"a_scale has shape {tuple(a_scale.shape)}; expected [M, ceil(K / bk)] = [{m}, {groups}]")
    if tuple(b_scale.shape) != (triton.cdiv(n, bn), groups):
        raise ValueError(f"b_scale has shape {tuple(b_scale.shape)}; expected [ceil(N / bn), ceil(K / bk)] = "
                         f"[{triton.cdiv(n, bn)}, {groups}]")
    return bn, bk


def fp8_block_gemm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                   block_size, out_dtype: torch.dtype) -> torch.Tensor:
    """y [M, N] = (a * a_scale) @ (b * b_scale).T in fp32, cast to out_dtype (see the module doc)."""
    bn, bk = _check_block_operands(a, a_scale, b, b_scale, block_size)
    m, n = a.shape[0], b.shape[0]
    c = torch.empty((m, n), dtype=out_dtype, device=a.device)
    # Decode (a few rows) streams the weight: the smallest dot tile in M, wide in N.
    block_m = 16 if m <= 16 else 64
    block_n = 64 if m <= 16 else 128
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _fp8_block_gemm_kernel[grid](
        a, b, c, a_scale, b_scale, m, n, a.shape[1], bn,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
        a_scale.stride(0), a_scale.stride(1), b_scale.stride(0), b_scale.stride(1),
        UPCAST=_interpreted(), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=bk,
        num_warps=4, num_stages=3)
    return c


def per_token_group_quant_fp8(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K] fp8, scale [M, ceil(K / group)] fp32): each row's groups of `group`
    columns scaled so their largest magnitude is FP8's 448 (the last group may be short)."""
    m, k = x.shape
    groups = -(-k // group)
    xf = torch.nn.functional.pad(x.float(), (0, groups * group - k)).view(m, groups, group)
    scale = (xf.abs().amax(-1) / FP8_MAX).clamp(min=MIN_SCALE)  # [M, groups]
    q = (xf / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(m, groups * group)[:, :k].contiguous(), scale


def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, block_size,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (any float dtype) @ weight [N, K] fp8 with block scales, + bias -> [M, N] in x's dtype.
    The activations are quantized per token per bk columns first (DeepSeek-V3's recipe)."""
    if x.dim() != 2 or x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"x must be a 2-D float tensor, got {x.dtype} of shape {tuple(x.shape)}")
    a, a_scale = per_token_group_quant_fp8(x, _check_block_size(block_size)[1])
    y = fp8_block_gemm(a, a_scale, weight, weight_scale, block_size, x.dtype)
    return y if bias is None else y + bias


# -- pure-torch reference (the test oracle) ------------------------------------------------------------
def dequantize_block_fp8(w: torch.Tensor, scale: torch.Tensor, block_size) -> torch.Tensor:
    """w [N, K] fp8 with scale [ceil(N / bn), ceil(K / bk)] -> [N, K] fp32."""
    bn, bk = block_size
    n, k = w.shape
    full = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return w.float() * full


def fp8_block_gemm_ref(a, a_scale, b, b_scale, block_size, out_dtype) -> torch.Tensor:
    bn, bk = block_size
    a_deq = dequantize_block_fp8(a, a_scale, (1, bk))
    return (a_deq @ dequantize_block_fp8(b, b_scale, (bn, bk)).T).to(out_dtype)
