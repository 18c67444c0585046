"""Fused elementwise ops of the CPU path (kernels/cpu_ops.c), called through ctypes.

Each function returns None when the C op does not apply (the library is
disabled or unbuildable, a tensor not on CPU or of a dtype the op does not take,
or a layout it does not take), and the caller then runs its own torch code: one
implementation per op in the layers, and this as the fast path in front of it.
The norm and the activation take fp32, bf16 and fp16 and round where torch's ops
in that dtype would (their tests compare with those ops); so does rotary, whose cos/sin table
is fp32 (rounded to the tensor's dtype first, as the layer's torch path does).
"""
from __future__ import annotations

import ctypes
import functools

import torch

from kernels.cpu_build import bind_signatures, load_kernel_library
from kernels.cpu_dtypes import DT_CODES

_LIB_NAME = "cpu_ops"
_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {  # name: (argtypes, restype), as declared in cpu_ops.c
    "rayllm_add_rms_norm": ([_P, _I, _P, _P, _P, _I, _I, _I, _F, _I, _I], None),
    "rayllm_silu_and_mul": ([_P, _I, _P, _I, _I, _I], None),
    "rayllm_rotary_neox": ([_P, _I, _P, _P, _I, _I, _I, _I], None),
    "rayllm_store_kv": ([_P, _I, _P, _I, _P, _P, _P, _I, _I, _I], ctypes.c_int),
}


@functools.lru_cache(maxsize=None)
def _lib():
    """The loaded library with its signatures set, or None (disabled or unbuildable)."""
    return bind_signatures(load_kernel_library(_LIB_NAME), _SIGNATURES)


def _on_cpu(dtype: torch.dtype, *tensors: torch.Tensor) -> bool:
    """Whether every tensor is `dtype` on CPU with a unit last stride."""
    for t in tensors:  # a plain loop: this runs a dozen times per layer per step
        if t.dtype != dtype or t.device.type != "cpu" or t.stride(-1) != 1:
            return False
    return True


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> torch.Tensor | None:
    """x [n, h] (2-D, rows may be strided), residual [n, h] contiguous or None, weight [h];
    x and residual fp32, bf16 or fp16 alike, weight x's dtype or fp32.

    Without residual: a new tensor norm(x) * weight. With it: residual += x in place and
    x is overwritten with norm(residual) * weight and returned (the caller drops x).
    """
    lib = _lib()
    if (lib is None or x.dim() != 2 or x.dtype not in DT_CODES or not _on_cpu(x.dtype, x)
            or weight.dtype not in (x.dtype, torch.float32) or not _on_cpu(weight.dtype, weight)
            or not weight.is_contiguous()):
        return None
    if residual is not None and (not _on_cpu(x.dtype, residual) or not residual.is_contiguous()
                                 or residual.shape != x.shape):
        return None
    n, h = x.shape
    out = x if residual is not None else torch.empty((n, h), dtype=x.dtype)
    lib.rayllm_add_rms_norm(x.data_ptr(), x.stride(0), None if residual is None else residual.data_ptr(),
                            weight.data_ptr(), out.data_ptr(), out.stride(0), n, h, eps, DT_CODES[x.dtype],
                            DT_CODES[weight.dtype])
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor | None:
    """x [n, 2 * d] = [gate | up] (fp32, bf16 or fp16) -> silu(gate) * up, [n, d]."""
    lib = _lib()
    if lib is None or x.dim() != 2 or x.shape[1] % 2 or x.dtype not in DT_CODES or not _on_cpu(x.dtype, x):
        return None
    n, d = x.shape[0], x.shape[1] // 2
    out = torch.empty((n, d), dtype=x.dtype)
    lib.rayllm_silu_and_mul(x.data_ptr(), x.stride(0), out.data_ptr(), n, d, DT_CODES[x.dtype])
    return out


def rotary_applies(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> bool:
    """Whether rotary_neox_ takes these: x [n, heads, D] fp32, bf16 or fp16 (heads D apart, rows
    any stride), positions [n] int64 contiguous, cos_sin [max_pos, D] fp32 contiguous."""
    return (_lib() is not None and x.dim() == 3 and x.stride(1) == x.shape[2] and x.dtype in DT_CODES
            and _on_cpu(x.dtype, x) and _on_cpu(torch.float32, cos_sin) and cos_sin.is_contiguous()
            and cos_sin.shape[1] == x.shape[2]
            and positions.dtype == torch.int64 and positions.is_contiguous()
            and positions.shape == x.shape[:1])


def rotary_neox_(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> None:
    """Rotate x in place (neox halves); rotary_applies(x, positions, cos_sin) must hold.
    Positions are not range-checked: the caller's cos_sin covers max_position."""
    n, heads, D = x.shape
    _lib().rayllm_rotary_neox(x.data_ptr(), x.stride(0), positions.data_ptr(), cos_sin.data_ptr(), n, heads, D,
                              DT_CODES[x.dtype])


def store_kv(key, value, k_cache, v_cache, slot_mapping) -> bool:
    """Scatter key/value [n, kv_heads, D] rows into the caches [num_blocks, block_size,
    kv_heads, D] at slot_mapping [n] (int64; < 0 skips); all four one dtype (fp32, bf16 or
    fp16: the rows are copied as bytes). Arguments already validated
    (kernels._validate.check_store_kv). Returns False when the C op does not apply."""
    lib = _lib()
    if (lib is None or key.dtype not in DT_CODES or not _on_cpu(key.dtype, key, value, k_cache, v_cache)
            or slot_mapping.dtype != torch.int64 or not slot_mapping.is_contiguous()
            or key.stride(1) != key.shape[2] or value.stride(1) != value.shape[2]):
        return False
    num_blocks, block_size, kv_heads, head_dim = k_cache.shape
    size = key.element_size()
    err = lib.rayllm_store_kv(key.data_ptr(), key.stride(0) * size, value.data_ptr(), value.stride(0) * size,
                              k_cache.data_ptr(), v_cache.data_ptr(), slot_mapping.data_ptr(),
                              key.shape[0], kv_heads * head_dim * size, num_blocks * block_size)
    if err:
        raise ValueError(f"slot_mapping holds slot {int(slot_mapping.max())} >= cache size "
                         f"{num_blocks * block_size}")
    return True
