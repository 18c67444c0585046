"""Group-wise int4 linear on CPU (kernels/cpu_int4.c), called through ctypes.

`pack_int4_cpu` turns the shared int4 layout (kernels/triton_int4_gemm.py: qweight [K / 8, N]
int32, scales [G, N] fp16, zeros [G, N] uint8, g_idx [K] int32) into the C kernel's, once at load:

    codes  [N, K / 2] uint8   the codes along K (sorted by group) in 32-input blocks, each 4
                              outputs' blocks interleaved (cpu_int4.c; the shape is nominal)
    scales [N, S] fp16        per output and segment: a run of sorted inputs in one group
    zeros  [N, S] uint8
    bounds [S + 1] int32      segment s covers sorted inputs [bounds[s], bounds[s + 1])
    perm   [K] int32          x's column of each sorted input; empty when g_idx is already in order

the same bytes as the shared layout (groups absent from this rank's g_idx are dropped).
`int4_linear_cpu` computes x @ W^T (+ bias) from it: the C kernel below `DENSE_MIN_ROWS` rows of
x (codes unpacked in registers up to `DIRECT_MAX_ROWS`, through an fp32 buffer above); from there
the C code dequantizes tiles of W for torch's dense matmul, whose blocking reuses each weight
across rows better than the kernel's register tile.
"""
from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.cpu_build import bind_signatures, load_kernel_library

_LIB_NAME = "cpu_int4"
_P, _I = ctypes.c_void_p, ctypes.c_int64
_SIGNATURES = {  # name: (argtypes, restype), as declared in cpu_int4.c
    "rayllm_int4_gemm_f32": ([_P, _I, _I, _P, _P, _P, _P, _I, _I, _I, _P, _P, _I], ctypes.c_int),
    "rayllm_int4_dequant_f32": ([_P, _P, _P, _P, _I, _I, _I, _I, _I, _P], None),
}
DIRECT_MAX_ROWS = 8  # up to this many rows of x, codes unpacked straight into registers
DENSE_MIN_ROWS = 32  # from this many rows, dequantized tiles and torch's matmul
DENSE_TILE_ELEMS = 1 << 21  # fp32 weights per dequantized tile (8 MiB)
BLOCK = 32  # inputs per packed block (cpu_int4.c)
OUTPUTS_PER_TILE = 4  # outputs whose blocks interleave (cpu_int4.c's NR)
X_DTYPES = (torch.float32, torch.bfloat16)
BIAS_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@functools.lru_cache(maxsize=None)
def _lib():
    """The loaded library with its signatures set, or None (disabled or unbuildable)."""
    return bind_signatures(load_kernel_library(_LIB_NAME), _SIGNATURES)


def available() -> bool:
    """Whether the C kernel is built and loaded (False: disabled, or no compiler)."""
    return _lib() is not None


@dataclass
class CpuInt4Weights:
    """The C kernel's layout (module docstring), checked once here: calls check only x."""

    codes: torch.Tensor   # [N, K / 2] uint8, 32-input blocks
    scales: torch.Tensor  # [N, S] fp16
    zeros: torch.Tensor   # [N, S] uint8
    bounds: torch.Tensor  # [S + 1] int32, from 0 to K
    perm: torch.Tensor    # [K] int32, or [0] when the inputs are already in group order

    def __post_init__(self):
        n, k = self.shape
        num_segments = self.bounds.numel() - 1
        expected = dict(codes=(torch.uint8, (n, k // 2)), scales=(torch.float16, (n, num_segments)),
                        zeros=(torch.uint8, (n, num_segments)), bounds=(torch.int32, (num_segments + 1,)))
        for name, (dtype, shape) in expected.items():
            t = getattr(self, name)
            if t.dtype != dtype or tuple(t.shape) != shape or not t.is_contiguous() or t.device.type != "cpu":
                raise ValueError(f"{name} must be a contiguous CPU {dtype} tensor of shape {shape}; "
                                 f"got {t.dtype} {tuple(t.shape)} on {t.device}")
        if num_segments < 1 or int(self.bounds[0]) != 0 or int(self.bounds[-1]) != k or \
                bool((self.bounds[1:] <= self.bounds[:-1]).any()):
            raise ValueError(f"bounds must rise strictly from 0 to K={k}; got {self.bounds.tolist()}")
        if self.perm.dtype != torch.int32 or self.perm.numel() not in (0, k):
            raise ValueError(f"perm must be int32 of {k} entries or empty; got {self.perm.dtype} "
                             f"{tuple(self.perm.shape)}")
        # The C signature's weight arguments, in order (the tensors live as long as self).
        self.c_args = (self.codes.data_ptr(), self.scales.data_ptr(), self.zeros.data_ptr(),
                       self.bounds.data_ptr(), num_segments, k, n)

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K) of the logical weight."""
        return self.codes.shape[0], self.codes.shape[1] * 2


def _pack_blocks(codes: torch.Tensor) -> torch.Tensor:
    """[N, K] codes 0..15 -> [N, K / 2] bytes: byte j of each block of w inputs pairs j (low
    nibble) with j + w / 2 (high); w = 32, or K % 32 for the last block."""
    n, k = codes.shape
    full = k - k % BLOCK
    parts = []
    for start, end, width in ((0, full, BLOCK), (full, k, k % BLOCK)):
        if end > start:
            c = codes[:, start:end].reshape(n, -1, 2, width // 2)
            parts.append((c[:, :, 0] | c[:, :, 1] << 4).reshape(n, -1))
    return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]


def _interleave(rows: torch.Tensor, nr: int) -> torch.Tensor:
    """[T * nr, K / 2] packed rows -> flat bytes, each nr outputs' blocks taken in turn: block 0
    of outputs 0..nr-1, block 1 of them, ..., their short last blocks."""
    tiles, half_k = rows.shape[0] // nr, rows.shape[1]
    full = half_k - half_k % (BLOCK // 2)  # bytes of the whole 32-input blocks
    t = rows.reshape(tiles, nr, half_k)
    blocks = t[:, :, :full].reshape(tiles, nr, -1, BLOCK // 2).transpose(1, 2)
    return torch.cat([blocks.reshape(tiles, -1), t[:, :, full:].reshape(tiles, -1)], dim=1).reshape(-1)


def _interleave_outputs(rows: torch.Tensor) -> torch.Tensor:
    """[N, K / 2] packed rows -> the kernel's order (OUTPUTS_PER_TILE outputs interleaved, a last
    short tile of N % OUTPUTS_PER_TILE on its own), shape kept."""
    whole = rows.shape[0] - rows.shape[0] % OUTPUTS_PER_TILE
    parts = [_interleave(rows[:whole], OUTPUTS_PER_TILE)] if whole else []
    if rows.shape[0] > whole:
        parts.append(_interleave(rows[whole:], rows.shape[0] - whole))
    return torch.cat(parts).reshape(rows.shape)


def pack_int4_cpu(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                  g_idx: torch.Tensor) -> CpuInt4Weights:
    """The shared int4 layout (already checked by check_int4_gemm) -> the C kernel's."""
    if scales.dtype != torch.float16:
        raise ValueError(f"scales must be float16 for the CPU int4 kernel; got {scales.dtype}")
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    codes = ((qweight[:, None, :] >> shifts[None, :, None]) & 0xF).reshape(-1, qweight.shape[1])  # [K, N]
    g = g_idx.long()
    in_order = bool((g[1:] >= g[:-1]).all())
    order = torch.arange(g.numel()) if in_order else torch.sort(g, stable=True).indices
    groups, counts = torch.unique_consecutive(g[order], return_counts=True)
    bounds = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]).to(torch.int32)
    return CpuInt4Weights(
        codes=_interleave_outputs(_pack_blocks(codes[order].T.to(torch.uint8))).contiguous(),
        scales=scales[groups].T.contiguous(), zeros=zeros[groups].T.contiguous(), bounds=bounds,
        perm=torch.empty(0, dtype=torch.int32) if in_order else order.to(torch.int32))


def _check(x: torch.Tensor, w: CpuInt4Weights, bias: torch.Tensor | None) -> None:
    """ValueError naming x or bias when the kernel cannot take it (the weights were checked once)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype not in X_DTYPES or x.device.type != "cpu":
        got = f"{x.dtype} {tuple(x.shape)} on {x.device}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x must be a 2-D float32 or bfloat16 CPU tensor; got {got}")
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"x has {x.shape[1]} input features; the weight has {w.shape[1]}")
    if bias is not None and (bias.dtype not in BIAS_DTYPES or bias.shape != (w.shape[0],)):
        raise ValueError(f"bias must be a float tensor of shape ({w.shape[0]},); got {bias.dtype} "
                         f"{tuple(bias.shape)}")


def _dense_tiles(x: torch.Tensor, w: CpuInt4Weights, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] fp32 @ W^T through fp32 tiles of W (DENSE_TILE_ELEMS each) and F.linear."""
    n, k = w.shape
    tile = max(1, DENSE_TILE_ELEMS // k)
    out = []
    for n0 in range(0, n, tile):
        n1 = min(n0 + tile, n)
        dense = torch.empty(n1 - n0, k)
        _lib().rayllm_int4_dequant_f32(*w.c_args, n0, n1, dense.data_ptr())
        out.append(F.linear(x, dense, None if bias is None else bias[n0:n1]))
    return torch.cat(out, dim=1) if len(out) > 1 else out[0]


def int4_linear_cpu(x: torch.Tensor, w: CpuInt4Weights, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ W^T (+ bias [N]) -> [M, N] in x's dtype, computed in fp32; the C kernel must be
    available."""
    _check(x, w, bias)
    lib = _lib()
    if lib is None:
        raise RuntimeError("the CPU int4 kernel is not available (disabled, or no C compiler)")
    xf = x.float()  # x itself when fp32
    if w.perm.numel():
        xf = xf.index_select(1, w.perm)
    if xf.stride(1) != 1:
        xf = xf.contiguous()
    m, n = xf.shape[0], w.shape[0]
    if bias is not None:
        bias = bias.float().contiguous()
    if m >= DENSE_MIN_ROWS:
        return _dense_tiles(xf, w, bias).to(x.dtype)
    y = torch.empty(m, n)
    if m and lib.rayllm_int4_gemm_f32(xf.data_ptr(), m, xf.stride(0), *w.c_args,
                                      None if bias is None else bias.data_ptr(), y.data_ptr(), DIRECT_MAX_ROWS):
        raise MemoryError("cpu_int4: could not allocate a thread's scratch buffers")
    return y.to(x.dtype)
