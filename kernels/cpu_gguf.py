"""y = x @ W.T on CPU with W in GGUF blocks (kernels/cpu_gguf.c), called through ctypes.

Few rows of x (decode): the C matmul, which dequantizes W a 16 x 256 tile at a time inside the
dot products, so W streams from memory as bytes. Many rows (prefill): W is dequantized by the C
code a TILE_ROWS slab at a time and multiplied by torch's BLAS, which beats hand-written dot
products once each dequantized tile is reused by enough rows. Without the library (no compiler,
RAYLLM_DISABLE_CPU_KERNEL=1) the same tiling runs on kernels/torch_gguf.py's dequantizer.
"""
from __future__ import annotations

import ctypes
import functools

import torch

from kernels.cpu_build import load_kernel_library
from kernels.torch_gguf import TILE_ROWS, check_weight, dequantize, gguf_linear_ref

_LIB_NAME = "cpu_gguf"
_P, _I, _C = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {  # name: (argtypes, restype), as declared in cpu_gguf.c
    "rayllm_gguf_linear_f32": ([_P, _I, _P, _I, _C, _P, _I, _I, _I, _I], _C),
    "rayllm_gguf_dequant_f32": ([_P, _I, _C, _P, _I, _I], _C),
}
# Rows of x from which the dequantize-a-slab-then-BLAS path wins over the fused C matmul
# (where the two cross in python -m loadtest.cpu_gguf_bench).
MANY_ROWS = 16


@functools.lru_cache(maxsize=None)
def _lib():
    """The loaded library with its signatures set, or None (disabled or unbuildable)."""
    lib = load_kernel_library(_LIB_NAME)
    if lib is not None:
        for name, (argtypes, restype) in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, restype
    return lib


def available() -> bool:
    return _lib() is not None


def _call(rc: int, qtype: int) -> None:
    if rc != 0:
        raise ValueError(f"cpu_gguf: GGUF type id {qtype} has no C dequantizer")


def dequantize_c(weight: torch.Tensor, qtype: int, in_features: int) -> torch.Tensor:
    """uint8 rows [rows, row_bytes] -> fp32 [rows, in_features] by the C dequantizer."""
    out = torch.empty(weight.shape[0], in_features, dtype=torch.float32)
    _call(_lib().rayllm_gguf_dequant_f32(weight.data_ptr(), weight.stride(0), qtype, out.data_ptr(),
                                         weight.shape[0], in_features), qtype)
    return out


def gguf_linear_cpu(x: torch.Tensor, weight: torch.Tensor, qtype: int) -> torch.Tensor:
    """x [n, in] (any float dtype, on CPU) @ W.T -> [n, out] in x's dtype; W uint8 [out, row_bytes]
    rows of `qtype` blocks (kernels/torch_gguf.py). ValueError for a wrong dtype, shape or type."""
    if x.dim() != 2 or x.device.type != "cpu" or weight.device.type != "cpu":
        raise ValueError(f"gguf_linear_cpu takes a 2-D CPU x and weight, got x {tuple(x.shape)} on {x.device}, "
                         f"weight on {weight.device}")
    check_weight(weight, qtype, x.shape[1])
    if _lib() is None:
        return gguf_linear_ref(x, weight, qtype)
    weight = weight.contiguous()
    xf = x.float().contiguous()
    n, out_features = x.shape[0], weight.shape[0]
    if n >= MANY_ROWS:
        y = torch.empty(n, out_features, dtype=torch.float32)
        for o in range(0, out_features, TILE_ROWS):
            y[:, o:o + TILE_ROWS] = xf @ dequantize_c(weight[o:o + TILE_ROWS], qtype, x.shape[1]).T
        return y.to(x.dtype)
    y = torch.empty(n, out_features, dtype=torch.float32)
    _call(_lib().rayllm_gguf_linear_f32(xf.data_ptr(), xf.stride(0), weight.data_ptr(), weight.stride(0), qtype,
                                        y.data_ptr(), y.stride(0), n, out_features, x.shape[1]), qtype)
    return y.to(x.dtype)


__all__ = ["MANY_ROWS", "available", "dequantize", "dequantize_c", "gguf_linear_cpu"]
