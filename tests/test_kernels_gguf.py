"""The GGUF block matmuls (kernels/cpu_gguf.c and its torch fallback, kernels/triton_gguf_gemm.py
under the Triton interpreter on CPU) against llama.cpp's own dequantization (gguf.quants) + matmul."""
import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from tests.triton_device import DEVICE  # before kernels: sets the interpreter up

from kernels import cpu_gguf  # noqa: E402
from kernels.torch_gguf import dequantize  # noqa: E402
from kernels.triton_gguf_gemm import gguf_gemm  # noqa: E402

TYPES = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K]
# The 32-element types, which gguf can quantize itself.
_GGUF_QUANTIZES = (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1)
# Where each type keeps its fp16 scale(s): (byte offset, how many).
_SCALE_FIELDS = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208, 1)}


def gguf_blocks(qtype, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """uint8 [rows, row_bytes] of `qtype`: gguf's quantizer on normal values where it has one
    (the 32-element types), else random blocks (every bit pattern of the quants and 6-bit scales is
    valid) whose fp16 d / dmin are set to small finite values."""
    rng = np.random.default_rng(seed)
    if qtype in _GGUF_QUANTIZES:
        return gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32) * 0.05, qtype)
    elems, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows, cols // elems, nbytes), dtype=np.uint8)
    start, count = _SCALE_FIELDS[qtype]
    scales = rng.uniform(-0.01, 0.01, (rows, cols // elems, count)).astype(np.float16)
    blocks[..., start:start + 2 * count] = scales.view(np.uint8)
    return blocks.reshape(rows, -1)


def _case(qtype, n: int, out: int, cols: int, seed: int = 0):
    blocks = gguf_blocks(qtype, out, cols, seed)
    w = torch.from_numpy(gguf.quants.dequantize(blocks, qtype).astype(np.float64))
    x = torch.randn(n, cols, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return x.float(), torch.from_numpy(blocks), (x @ w.T).float()


def _close(ours: torch.Tensor, expected: torch.Tensor, rtol: float = 1e-5) -> None:
    scale = expected.abs().max().item()
    torch.testing.assert_close(ours.float().cpu(), expected, atol=rtol * scale, rtol=0)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_torch_dequantize_equals_gguf(qtype):
    blocks = gguf_blocks(qtype, 7, 512, seed=3)
    expected = gguf.quants.dequantize(blocks, qtype).astype(np.float32)
    np.testing.assert_array_equal(dequantize(torch.from_numpy(blocks), int(qtype)).numpy(), expected)


@pytest.mark.parametrize("n", [1, 3, 17, 40, 100])  # partial 4-row blocks; 100 x 768: two 256 KiB x blocks
@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_cpu_kernel_matches_dequantize_and_matmul(qtype, n):
    assert cpu_gguf.available(), "the C kernel did not build"
    x, w, expected = _case(qtype, n, out=37, cols=768, seed=n)  # 37: a partial 16-row tile
    _close(cpu_gguf.gguf_linear_cpu(x, w, int(qtype)), expected)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_cpu_torch_fallback_matches(qtype, monkeypatch):
    monkeypatch.setattr(cpu_gguf, "_lib", lambda: None)  # as without a C compiler
    x, w, expected = _case(qtype, 5, out=300, cols=512)  # 300 rows: more than one fallback tile
    _close(cpu_gguf.gguf_linear_cpu(x, w, int(qtype)), expected)


def test_cpu_kernel_keeps_x_dtype_and_strided_rows():
    x, w, expected = _case(Q.Q4_K, 4, out=16, cols=256)
    wide = torch.zeros(4, 300)
    wide[:, :256] = x
    _close(cpu_gguf.gguf_linear_cpu(wide[:, :256], w, int(Q.Q4_K)), expected)
    y = cpu_gguf.gguf_linear_cpu(x.bfloat16(), w, int(Q.Q4_K))
    assert y.dtype == torch.bfloat16
    _close(y, expected, rtol=2e-2)


@pytest.mark.parametrize("n", [1, 19])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_triton_gemm_matches_dequantize_and_matmul(qtype, n):
    x, w, expected = _case(qtype, n, out=23, cols=512, seed=n)  # 23: a partial 16-wide n tile
    y = gguf_gemm(x.to(DEVICE), w.to(DEVICE), int(qtype), block_m=16, block_n=16)
    _close(y, expected, rtol=1e-4 if DEVICE == "cuda" else 1e-5)


@pytest.mark.skipif(DEVICE != "cuda", reason="half-precision tl.dot: the tensor-core path")
def test_triton_gemm_half_precision():
    x, w, expected = _case(Q.Q4_K, 33, out=128, cols=1024)
    y = gguf_gemm(x.to(DEVICE, torch.bfloat16), w.to(DEVICE), int(Q.Q4_K))
    assert y.dtype == torch.bfloat16
    _close(y, expected, rtol=3e-2)


def test_wrong_shapes_and_types_are_named():
    w = torch.from_numpy(gguf_blocks(Q.Q8_0, 4, 64))
    with pytest.raises(ValueError, match="not a multiple of Q4_K's block of 256"):
        cpu_gguf.gguf_linear_cpu(torch.zeros(2, 64), w, int(Q.Q4_K))
    with pytest.raises(ValueError, match=r"Q8_0 weight must be uint8 \[out, 68\]"):
        cpu_gguf.gguf_linear_cpu(torch.zeros(2, 64), w[:, :34], int(Q.Q8_0))
    with pytest.raises(ValueError, match="GGUF type id 10 has no packed kernel"):
        cpu_gguf.gguf_linear_cpu(torch.zeros(2, 64), w, int(Q.Q2_K))
    with pytest.raises(ValueError, match="2-D float x"):
        gguf_gemm(torch.zeros(2, 64, dtype=torch.int32, device=DEVICE), w.to(DEVICE), int(Q.Q8_0))
