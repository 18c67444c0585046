"""y = x @ W.T on CPU with W in GGUF blocks (kernels/cpu_gguf.c), called through ctypes.

One C matmul for every row count: W is dequantized NR rows at a time into a per-thread buffer
and multiplied right away with all rows of x in register blocks, so W is never dense in memory
and each block is dequantized once per call. Without the library (no compiler,
RAYLLM_DISABLE_CPU_KERNEL=1) kernels/torch_gguf.py's tiled reference runs instead.
"""
from __future__ import annotations

import ctypes
import functools

import torch

from kernels.cpu_build import bind_signatures, load_kernel_library
from kernels.torch_gguf import check_weight, dequantize, gguf_linear_ref

_LIB_NAME = "cpu_gguf"
_P, _I, _C = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {  # name: (argtypes, restype), as declared in cpu_gguf.c
    "rayllm_gguf_linear_f32": ([_P, _I, _P, _I, _C, _P, _I, _I, _I, _I], _C),
}
_ERR_TYPE, _ERR_NOMEM = 1, 2  # cpu_gguf.c's return codes


@functools.lru_cache(maxsize=None)
def _lib():
    """The loaded library with its signatures set, or None (disabled or unbuildable)."""
    return bind_signatures(load_kernel_library(_LIB_NAME), _SIGNATURES)


def available() -> bool:
    return _lib() is not None


def _call(rc: int, qtype: int) -> None:
    if rc == _ERR_TYPE:
        raise ValueError(f"cpu_gguf: GGUF type id {qtype} has no C dequantizer")
    if rc == _ERR_NOMEM:
        raise MemoryError("cpu_gguf: a thread's row buffer could not be allocated")


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
    y = torch.empty(n, out_features, dtype=torch.float32)
    _call(_lib().rayllm_gguf_linear_f32(xf.data_ptr(), xf.stride(0), weight.data_ptr(), weight.stride(0), qtype,
                                        y.data_ptr(), y.stride(0), n, out_features, x.shape[1]), qtype)
    return y.to(x.dtype)


__all__ = ["available", "dequantize", "gguf_linear_cpu"]
