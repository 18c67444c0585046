"""FP8 (e4m3fn) weight-only linear on CPU (kernels/cpu_fp8.c), called through ctypes.

    fp8_linear(x, w, scale, block, bias)   x [..., K] @ (fp8(w) * scale).T -> [..., N]
    dequantize_rows(w, scale, block, r0, r1) -> fp32 [r1 - r0, K]   (the prefill tiles)

`scale` is [1] (per tensor), [N] or [N, 1] (per row) with block None, or
[ceil(N / bn), ceil(K / bk)] with block = (bn, bk). Both functions need the C
library (`available()`); the pure-torch reference, which is also the fallback
where the library is disabled or unbuildable, is `dequantize_reference`.
"""
from __future__ import annotations

import ctypes
import functools

import torch

from kernels.cpu_build import bind_signatures, load_kernel_library

_LIB_NAME = "cpu_fp8"
_P, _I = ctypes.c_void_p, ctypes.c_int64
_SIGNATURES = {  # name: (argtypes, restype), as declared in cpu_fp8.c
    "rayllm_fp8_linear_f32": ([_P, _I, _P, _P, _I, _I, _I, _P, _P, _I, _I, _I], ctypes.c_int),
    "rayllm_fp8_dequant_rows_f32": ([_P, _P, _I, _I, _I, _P, _I, _I, _I], None),
    "rayllm_fp8_e4m3_to_f32": ([_P, _P, _I], None),
}
X_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # the latter two computed in fp32
W_DTYPES = (torch.float8_e4m3fn, torch.uint8)


@functools.lru_cache(maxsize=None)
def _lib():
    """The loaded library with its signatures set, or None (disabled or unbuildable)."""
    return bind_signatures(load_kernel_library(_LIB_NAME), _SIGNATURES)


def available() -> bool:
    return _lib() is not None


def _require_lib():
    lib = _lib()
    if lib is None:
        raise RuntimeError("the cpu_fp8 C kernel is unavailable (disabled or unbuildable); "
                           "use dequantize_reference")
    return lib


def _scale_layout(w: torch.Tensor, scale: torch.Tensor, block) -> tuple[int, int, int]:
    """Checks w and scale; returns the C kernel's (scale_cols, bn, bk) for them."""
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or w.dtype not in W_DTYPES:
        raise ValueError(f"w must be a 2-D float8_e4m3fn or uint8 tensor [N, K], got "
                         f"{getattr(w, 'dtype', type(w).__name__)} {tuple(getattr(w, 'shape', ()))}")
    if w.device.type != "cpu" or not w.is_contiguous() or 0 in w.shape:
        raise ValueError(f"w must be non-empty and contiguous on CPU, got {w.device} shape {tuple(w.shape)} "
                         f"strides {w.stride()}")
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32 or scale.device.type != "cpu":
        raise ValueError(f"scale must be a float32 CPU tensor, got {getattr(scale, 'dtype', scale)}")
    n, k = w.shape
    if block is None:
        if scale.numel() == 1:
            return 1, n, k
        if scale.numel() == n and scale.shape in ((n,), (n, 1)):
            return 1, 1, k
        raise ValueError(f"scale shape {tuple(scale.shape)} fits neither per tensor [1] nor per row "
                         f"[{n}] / [{n}, 1] for w {tuple(w.shape)}")
    if not (isinstance(block, (tuple, list)) and len(block) == 2
            and all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"block must be (bn, bk) positive ints or None, got {block!r}")
    bn, bk = int(block[0]), int(block[1])
    want = (-(-n // bn), -(-k // bk))
    if tuple(scale.shape) != want:
        raise ValueError(f"block scale shape {tuple(scale.shape)} != {want} for w {tuple(w.shape)} "
                         f"and block {(bn, bk)}")
    return want[1], bn, bk


def _check_x_bias(x: torch.Tensor, k: int, n: int, bias) -> None:
    if not isinstance(x, torch.Tensor) or x.dtype not in X_DTYPES or x.device.type != "cpu" or x.dim() < 1:
        raise ValueError(f"x must be a float32/bfloat16/float16 CPU tensor, got "
                         f"{getattr(x, 'dtype', type(x).__name__)} on {getattr(x, 'device', '?')}")
    if x.shape[-1] != k:
        raise ValueError(f"x's last dim {x.shape[-1]} != w's K {k} (x {tuple(x.shape)})")
    if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (n,)
                             or bias.device.type != "cpu" or bias.dtype not in X_DTYPES):
        raise ValueError(f"bias must be a float CPU tensor [{n}], got "
                         f"{getattr(bias, 'dtype', bias)} {tuple(getattr(bias, 'shape', ()))}")


def fp8_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, block=None,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ (fp8(w) * scale).T (+ bias) -> [..., N] in x's dtype, fp32 accumulation.
    w [N, K] is read once whatever the row count, so this is the decode path (a few rows)."""
    scale_cols, bn, bk = _scale_layout(w, scale, block)
    n, k = w.shape
    _check_x_bias(x, k, n, bias)
    lib = _require_lib()
    x2 = x.reshape(-1, k).float()
    if x2.shape[0] > 0 and x2.stride(-1) != 1:
        x2 = x2.contiguous()
    b = None if bias is None else bias.float().contiguous()
    y = torch.empty((x2.shape[0], n), dtype=torch.float32)
    if x2.shape[0]:
        err = lib.rayllm_fp8_linear_f32(x2.data_ptr(), x2.stride(0), w.data_ptr(), scale.contiguous().data_ptr(),
                                        scale_cols, bn, bk, None if b is None else b.data_ptr(),
                                        y.data_ptr(), x2.shape[0], n, k)
        if err:
            raise MemoryError(f"cpu_fp8: no memory for a per-thread [rows, {k}] fp32 buffer")
    return y.reshape(*x.shape[:-1], n).to(x.dtype)


def dequantize_rows(w: torch.Tensor, scale: torch.Tensor, block, r0: int, r1: int,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """fp8(w[r0:r1]) * scale as fp32 [r1 - r0, K], written into `out` when given (a reused tile)."""
    scale_cols, bn, bk = _scale_layout(w, scale, block)
    n, k = w.shape
    if not 0 <= r0 <= r1 <= n:
        raise ValueError(f"rows [{r0}, {r1}) are outside w's {n} rows")
    if out is None:
        out = torch.empty((r1 - r0, k), dtype=torch.float32)
    elif out.dtype != torch.float32 or tuple(out.shape) != (r1 - r0, k) or not out.is_contiguous():
        raise ValueError(f"out must be contiguous float32 [{r1 - r0}, {k}], got {out.dtype} {tuple(out.shape)}")
    if r1 > r0:
        _require_lib().rayllm_fp8_dequant_rows_f32(w.data_ptr(), scale.contiguous().data_ptr(), scale_cols,
                                                   bn, bk, out.data_ptr(), r0, r1, k)
    return out


def e4m3_to_float(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [n] -> their e4m3fn values, fp32 [n], converted as the kernels convert."""
    if codes.dtype != torch.uint8 or codes.dim() != 1 or not codes.is_contiguous():
        raise ValueError(f"codes must be a contiguous 1-D uint8 tensor, got {codes.dtype} {tuple(codes.shape)}")
    out = torch.empty(codes.shape, dtype=torch.float32)
    _require_lib().rayllm_fp8_e4m3_to_f32(codes.data_ptr(), out.data_ptr(), codes.numel())
    return out


def dequantize_reference(w: torch.Tensor, scale: torch.Tensor, block, r0: int, r1: int) -> torch.Tensor:
    """Pure torch, any device: fp8(w[r0:r1]) * scale as fp32 [r1 - r0, K] (scales as above)."""
    tile = w[r0:r1].view(torch.float8_e4m3fn).to(torch.float32)
    if block is None:  # per tensor [1] or per row [N] / [N, 1]
        return tile * (scale.reshape(1) if scale.numel() == 1 else scale.reshape(-1, 1)[r0:r1])
    bn, bk = block
    s = scale[r0 // bn: -(-r1 // bn)].repeat_interleave(bn, 0)[r0 % bn: r0 % bn + r1 - r0]
    return tile * s.repeat_interleave(bk, 1)[:, : w.shape[1]]
