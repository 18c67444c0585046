"""INT8 W8A8 linear on CPU with AVX-512 VNNI or AMX (kernels/cpu_int8.c), called through ctypes.

    pack_int8_vnni(q [N, K] int8, scale [N] fp32) -> CpuInt8Weights       once, at load
    int8_linear_cpu(x [M, K], w, input_scale=None, isa="auto") -> [M, N] in x's dtype
    int8_matmul_s32_cpu(x, w, input_scale=None, isa="auto") -> (acc int32 [M, N], x_scale fp32 [M, 1])
    int8_linear_silu_cpu(x, w, input_scale=None) -> [M, N / 2]: silu(gate) * up of [gate | up], on AMX

x is fp32 or bf16. Without `input_scale` each row of x is quantized by its own absmax / 127 (per
token, dynamic); with it ([1] fp32, a checkpoint's static scale) every row by that. Then
acc = qx @ q^T in int32, and y = acc * x_scale * scale, all inside one C call: the quantized
activations never leave it. `int8_matmul_s32_cpu` stops at acc (what `torch._int_mm` gives) and
hands back the scales it used.

`isa`: "auto" multiplies with AMX tiles where this CPU and kernel offer them (`amx_available()`)
and the call has at least 8 rows, with AVX-512 VNNI otherwise; "vnni" or "amx" picks one (a
benchmark's comparison; "amx" raises where AMX does not run). Both give the same int32 sums, so
the same output, bit for bit. One packed layout serves both.

`available()` is False where the C library is disabled or unbuildable, or this CPU lacks AVX-512
VNNI (the build is -march=native, so the library itself says); callers keep their torch path
there. The torch reference, which is that path: quantize each row, `torch._int_mm`, scale.
"""
from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from kernels.cpu_build import bind_signatures, load_kernel_library
from kernels.cpu_dtypes import DT_CODES

_LIB_NAME = "cpu_int8"
_P, _I = ctypes.c_void_p, ctypes.c_int64
_SIGNATURES = {  # name: (argtypes, restype), as declared in cpu_int8.c
    "rayllm_int8_vnni_available": ([], ctypes.c_int),
    "rayllm_int8_amx_available": ([], ctypes.c_int),
    "rayllm_int8_w8a8_gemm": ([_P, _I, _I, _I, _P, _P, _P, _P, _I, _I, _P, _I, _P, _I], ctypes.c_int),
    "rayllm_int8_w8a8_gemm_silu": ([_P, _I, _I, _I, _P, _P, _P, _P, _I, _I, _P, _I, _P], ctypes.c_int),
}
LANES = 16  # outputs per packed block (cpu_int8.c)
K_GROUP = 4  # inputs per lane per vpdpbusd
K_ALIGN = 64  # K is padded with zeros to a multiple of this: whole AMX tiles (cpu_int8.c)
ISAS = {"auto": 0, "vnni": 1, "amx": 2}  # cpu_int8.c's ISA_*
# Largest K whose int32 sums cannot overflow: |sum (qx + 128) * w| <= K * 255 * 128 < 2^31.
MAX_K = (2**31 - 1) // (255 * 128)
X_DTYPES = (torch.float32, torch.bfloat16)
# Input and output types: cpu_simd.h's DT_* codes, and cpu_int8.c's OUT_I32 for the int32 sums.
_DTYPE_CODES = {**{t: DT_CODES[t] for t in X_DTYPES}, torch.int32: 3}
_ERRORS = {1: "this CPU build has no AVX-512 VNNI", 2: "out of memory for the quantized activations",
           3: "a dtype the kernel does not take", 4: "AMX does not run here (see amx_available())",
           5: "the gated matmul needs N a multiple of 32 ([gate | up], halves of whole blocks)"}


@functools.lru_cache(maxsize=None)
def _lib():
    """The loaded library with its signatures set, or None (disabled, unbuildable, or no VNNI)."""
    lib = bind_signatures(load_kernel_library(_LIB_NAME), _SIGNATURES)
    return lib if lib is not None and lib.rayllm_int8_vnni_available() else None


def available() -> bool:
    """Whether the VNNI kernel runs here (False: disabled, no C compiler, or no AVX-512 VNNI)."""
    return _lib() is not None


def amx_available() -> bool:
    """Whether the kernel can multiply with AMX tiles here (built with AMX-INT8, and Linux let
    this process use them)."""
    return available() and bool(_lib().rayllm_int8_amx_available())


def _packed_blocks_groups(n: int, k: int) -> tuple[int, int]:
    """The packed layout's blocks of LANES outputs and groups of K_GROUP inputs for an [n, k] weight
    (n padded to LANES, k to K_ALIGN)."""
    return -(-n // LANES), -(-k // K_ALIGN) * K_ALIGN // K_GROUP


@dataclass
class CpuInt8Weights:
    """The kernel's layout (cpu_int8.c), checked once here: calls check only x."""

    packed: torch.Tensor  # [Np / 16, Kp / 4, 16, 4] int8, zero-padded (Kp: K rounded up to K_ALIGN)
    comp: torch.Tensor    # [N] int32: 128 * sum_k q[n, k]
    scale: torch.Tensor   # [N] float32
    in_features: int      # K

    def __post_init__(self):
        n, k = self.shape
        if not 0 < k <= MAX_K:
            raise ValueError(f"in_features must be in 1..{MAX_K} (int32 sums); got {k}")
        blocks, groups = _packed_blocks_groups(n, k)
        expected = dict(packed=(torch.int8, (blocks, groups, LANES, K_GROUP)), comp=(torch.int32, (n,)),
                        scale=(torch.float32, (n,)))
        for name, (dtype, shape) in expected.items():
            t = getattr(self, name)
            if t.dtype != dtype or tuple(t.shape) != shape or not t.is_contiguous() or t.device.type != "cpu":
                raise ValueError(f"{name} must be a contiguous CPU {dtype} tensor of shape {shape}; "
                                 f"got {t.dtype} {tuple(t.shape)} on {t.device}")

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K) of the logical weight."""
        return self.comp.shape[0], self.in_features


def pack_int8_vnni(q: torch.Tensor, scale: torch.Tensor) -> CpuInt8Weights:
    """q int8 [N, K] and its per-output scale ([N] or [N, 1], any float dtype) -> the kernel's layout."""
    if not isinstance(q, torch.Tensor) or q.dtype != torch.int8 or q.dim() != 2 or q.device.type != "cpu":
        got = f"{q.dtype} {tuple(q.shape)} on {q.device}" if isinstance(q, torch.Tensor) else type(q).__name__
        raise ValueError(f"q must be a 2-D int8 CPU tensor [N, K]; got {got}")
    n, k = q.shape
    if not isinstance(scale, torch.Tensor) or scale.numel() != n or not scale.is_floating_point():
        raise ValueError(f"scale must be a float tensor of {n} entries (one per output); got "
                         f"{getattr(scale, 'dtype', type(scale).__name__)} {tuple(getattr(scale, 'shape', ()))}")
    blocks, groups = _packed_blocks_groups(n, k)
    padded = torch.zeros(blocks * LANES, groups * K_GROUP, dtype=torch.int8)
    padded[:n, :k] = q
    # [Np, Kp] -> [Np / 16, 16, Kp / 4, 4] -> [Np / 16, Kp / 4, 16, 4]: a block's 4-input groups in turn
    packed = padded.reshape(blocks, LANES, groups, K_GROUP).transpose(1, 2).contiguous()
    comp = (q.sum(dim=1, dtype=torch.int32) * 128).to(torch.int32)
    return CpuInt8Weights(packed, comp, scale.detach().float().reshape(n).contiguous(), k)


def _check(x: torch.Tensor, w: CpuInt8Weights, input_scale: torch.Tensor | None, isa: str) -> None:
    """ValueError naming x, input_scale or isa when the kernel cannot take it (the weights were checked once)."""
    if isa not in ISAS:
        raise ValueError(f"isa must be one of {sorted(ISAS)}; got {isa!r}")
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype not in X_DTYPES or x.device.type != "cpu":
        got = f"{x.dtype} {tuple(x.shape)} on {x.device}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x must be a 2-D float32 or bfloat16 CPU tensor; got {got}")
    if x.shape[1] != w.in_features:
        raise ValueError(f"x has {x.shape[1]} input features; the weight has {w.in_features}")
    if input_scale is not None and (not isinstance(input_scale, torch.Tensor) or input_scale.numel() != 1
                                    or input_scale.dtype != torch.float32 or input_scale.device.type != "cpu"):
        raise ValueError(f"input_scale must be one float32 CPU value or None; got "
                         f"{getattr(input_scale, 'dtype', type(input_scale).__name__)} "
                         f"{tuple(getattr(input_scale, 'shape', ()))}")


def _gemm(x: torch.Tensor, w: CpuInt8Weights, input_scale: torch.Tensor | None,
          out_dtype: torch.dtype, isa: str, gated: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, x_scale [M, 1]): y [M, N] in out_dtype, or with `gated` silu(gate) * up [M, N / 2] (AMX only)."""
    _check(x, w, input_scale, isa)
    lib = _lib()
    if lib is None:
        raise RuntimeError("the CPU int8 VNNI kernel is not available (disabled, no C compiler, or no AVX-512 VNNI)")
    if gated and not lib.rayllm_int8_amx_available():
        raise RuntimeError(f"cpu_int8: {_ERRORS[4]}")
    if x.stride(1) != 1:
        x = x.contiguous()
    m, n = x.shape[0], w.shape[0]
    y = torch.empty(m, n // 2 if gated else n, dtype=out_dtype)
    x_scale = torch.empty(m, 1, dtype=torch.float32)
    if m:
        args = (x.data_ptr(), m, x.stride(0), _DTYPE_CODES[x.dtype],
                None if input_scale is None else input_scale.data_ptr(), w.packed.data_ptr(), w.comp.data_ptr(),
                w.scale.data_ptr(), w.in_features, n, y.data_ptr(), _DTYPE_CODES[out_dtype], x_scale.data_ptr())
        err = lib.rayllm_int8_w8a8_gemm_silu(*args) if gated else lib.rayllm_int8_w8a8_gemm(*args, ISAS[isa])
        if err:
            raise {2: MemoryError, 5: ValueError}.get(err, RuntimeError)(f"cpu_int8: {_ERRORS.get(err, err)}")
    return y, x_scale


def int8_linear_cpu(x: torch.Tensor, w: CpuInt8Weights, input_scale: torch.Tensor | None = None,
                    isa: str = "auto") -> torch.Tensor:
    """x [M, K] fp32 / bf16 -> (quantized x) @ (q * scale)^T as [M, N] in x's dtype."""
    return _gemm(x, w, input_scale, x.dtype if isinstance(x, torch.Tensor) else torch.float32, isa)[0]


def int8_matmul_s32_cpu(x: torch.Tensor, w: CpuInt8Weights, input_scale: torch.Tensor | None = None,
                        isa: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (qx @ q^T as int32 [M, N], the x_scale [M, 1] fp32 each row was quantized by)."""
    return _gemm(x, w, input_scale, torch.int32, isa)


def int8_linear_silu_cpu(x: torch.Tensor, w: CpuInt8Weights, input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] -> silu(gate) * up of the [M, N] output's halves [gate | up], [M, N / 2] in x's dtype:
    int8_linear_cpu then cpu_ops.silu_and_mul to the bit, in one pass on AMX tiles (amx_available()
    must hold, and N be a multiple of 32)."""
    return _gemm(x, w, input_scale, x.dtype if isinstance(x, torch.Tensor) else torch.float32, "amx", gated=True)[0]


def quantize_reference(x: torch.Tensor, input_scale: torch.Tensor | None = None):
    """Pure torch: (qx int8 [M, K], x_scale fp32 [M, 1] or input_scale), quantized as the kernel does."""
    xf = x.float()
    if input_scale is None:
        x_scale = (xf.abs().amax(dim=1, keepdim=True) / 127.0).clamp_(min=1e-10)
    else:
        x_scale = input_scale.float().reshape(1, 1).expand(x.shape[0], 1)
    return torch.round(xf / x_scale).clamp_(-127, 127).to(torch.int8), x_scale


def int8_linear_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                          input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Pure torch, what the kernel computes: quantize x, `torch._int_mm`, both scales, x's dtype."""
    qx, x_scale = quantize_reference(x, input_scale)
    acc = torch._int_mm(qx, q.t()) if qx.shape[0] else torch.zeros(0, q.shape[0], dtype=torch.int32)
    return (acc.float() * x_scale * scale.float().reshape(-1)).to(x.dtype)
