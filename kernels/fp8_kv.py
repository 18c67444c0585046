"""The fp8 KV cache's number format: e4m3 values with one fp32 scale per tensor (vLLM's rule).

A cached value is stored as q = saturate(x / scale) rounded to e4m3 (3 mantissa bits, largest
finite 448, no infinities: saturating keeps an outlier at +-448 instead of turning it into NaN)
and read back as q * scale. Scales are [1] fp32 tensors on the cache's device, so kernels read
them without a host sync and CUDA graphs capture their address, not their value.

These torch functions are the arithmetic every path must match: the torch backend stores and
reads with them, the Triton kernels are tested bit-exact (store) or within the dtype's tolerance
(attention) against them.
"""
from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x (any float dtype) -> e4m3 of x / scale, saturated to +-FP8_MAX, rounded to nearest even."""
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """e4m3 q -> q * scale in `dtype` (the product taken in fp32, as the kernels do)."""
    return (q.float() * scale).to(dtype)
