"""The FP8 weight-only C kernel (kernels.cpu_fp8) against torch: every e4m3 code, the fused product
and the dequantized tiles for per-tensor, per-row and block scales at odd shapes, the layer's compute
(fp8.CpuFp8Kernel) either side of its row threshold, bad arguments named, and the torch fallback."""
import pytest
import torch

from engine.layers.quantization import fp8
from kernels import cpu_build, cpu_fp8

needs_kernel = pytest.mark.skipif(not cpu_fp8.available(), reason="the C kernel could not be built here")
FP8 = torch.float8_e4m3fn
NAN_CODES = (0x7F, 0xFF)
TOL = dict(atol=1e-4, rtol=1e-5)  # fp32 sums in another order


def _weight(n, k, seed=0):
    """[n, k] fp8 drawing every finite code (subnormals and zeros too), as uint8 bits."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (n, k), generator=g, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x42  # no NaNs here: they poison a whole output column
    return codes.view(FP8)


def _scale(kind, n, k, block):
    g = torch.Generator().manual_seed(1)
    if kind == "tensor":
        return torch.tensor([3e-3])
    if kind == "row":
        return torch.rand(n, 1, generator=g) * 4e-3 + 1e-4
    return torch.rand(-(-n // block[0]), -(-k // block[1]), generator=g) * 4e-3 + 1e-4


def _dense(w, scale, block):
    """The test's own dequantization: each element times its scale, expanded to [n, k]."""
    n, k = w.shape
    if block is None:
        full = scale.reshape(-1, 1).expand(n, k) if scale.numel() == n else scale.expand(n, k)
    else:
        full = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:n, :k]
    return w.float() * full


@needs_kernel
def test_every_code_converts_exactly_as_torch():
    codes = torch.arange(256, dtype=torch.uint8)
    expect = codes.view(FP8).float()
    vector = cpu_fp8.e4m3_to_float(codes)  # 16 codes a step
    scalar = torch.cat([cpu_fp8.e4m3_to_float(codes[i:i + 1]) for i in range(256)])  # the tail loop
    finite = torch.ones(256, dtype=torch.bool)
    finite[list(NAN_CODES)] = False
    for got in (vector, scalar):
        assert torch.equal(got[finite].view(torch.int32), expect[finite].view(torch.int32))  # -0.0 too
        assert got[~finite].isnan().all() and expect[~finite].isnan().all()  # e4m3fn's NaNs stay NaN
    assert expect[1] == 2.0 ** -9 and expect[0x7E] == 448  # the smallest subnormal, the largest normal


@needs_kernel
@pytest.mark.parametrize("kind, block", [("tensor", None), ("row", None), ("block", (16, 32)),
                                         ("block", (128, 128)), ("block", (3, 5))])
@pytest.mark.parametrize("m, n, k", [(1, 37, 101), (6, 64, 256), (13, 5, 33), (65, 131, 300)])
def test_fused_kernel_matches_the_dequantized_product(kind, block, m, n, k):
    w = _weight(n, k)
    scale = _scale(kind, n, k, block)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    bias = torch.randn(n) if m % 2 else None
    expect = torch.nn.functional.linear(x, _dense(w, scale, block), bias)
    torch.testing.assert_close(cpu_fp8.fp8_linear(x, w, scale, block, bias), expect, **TOL)
    torch.testing.assert_close(cpu_fp8.fp8_linear(x, w.view(torch.uint8), scale, block, bias), expect, **TOL)


@needs_kernel
@pytest.mark.parametrize("kind, block, r0, r1", [("tensor", None, 3, 40), ("row", None, 0, 41),
                                                 ("block", (16, 32), 5, 37), ("block", (7, 9), 0, 41)])
def test_dequantized_rows_are_exact(kind, block, r0, r1):
    w = _weight(41, 75)
    scale = _scale(kind, 41, 75, block)
    expect = _dense(w, scale, block)[r0:r1]
    assert torch.equal(cpu_fp8.dequantize_rows(w, scale, block, r0, r1), expect)
    assert torch.equal(cpu_fp8.dequantize_reference(w, scale, block, r0, r1), expect)


@needs_kernel
def test_large_scales_stay_exact():
    """A scale >= 2^8 overflows scale * 2^120 in fp32: the kernel multiplies in two steps there."""
    w, scale = _weight(8, 40), torch.tensor([1024.0, 3e5, 1e-30, 1.0, 255.9, 256.0, 7.0, 2.0 ** 100]).reshape(8, 1)
    assert torch.equal(cpu_fp8.dequantize_rows(w, scale, None, 0, 8), _dense(w, scale, None))


@needs_kernel
def test_strided_3d_and_bf16_inputs():
    w, scale = _weight(24, 48), _scale("row", 24, 48, None)
    dense = _dense(w, scale, None)
    wide = torch.randn(5, 64)
    x = wide[:, 8:56]  # rows 64 floats apart
    torch.testing.assert_close(cpu_fp8.fp8_linear(x, w, scale), x @ dense.T, **TOL)
    x3 = torch.randn(2, 3, 48)
    torch.testing.assert_close(cpu_fp8.fp8_linear(x3, w, scale), x3 @ dense.T, **TOL)
    xb = torch.randn(4, 48).bfloat16()
    out = cpu_fp8.fp8_linear(xb, w, scale)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), (xb.float() @ dense.T).bfloat16().float(), atol=0.02, rtol=0.02)


@needs_kernel
def test_a_nan_code_poisons_its_column_only():
    w = _weight(6, 20).view(torch.uint8).clone()
    w[2, 7] = 0xFF
    y = cpu_fp8.fp8_linear(torch.randn(3, 20), w, torch.tensor([1e-2]))
    assert y[:, 2].isnan().all() and not y[:, [0, 1, 3, 4, 5]].isnan().any()


@needs_kernel
@pytest.mark.parametrize("block", [None, (16, 32)])
def test_layer_compute_either_side_of_the_row_threshold(block):
    """choose_compute picks the kernel on CPU; rows up to 8 are converted in registers, more up to
    FUSED_MAX_ROWS through the kernel's row buffer, more still through C-dequantized tiles (w taller
    than one tile, so two); all equal the dequantized product."""
    compute = fp8.choose_compute(block, torch.device("cpu"), 96, 1)
    assert isinstance(compute, fp8.CpuFp8Kernel)
    k = 96
    n = compute.tile_elems // k + 37
    w, scale = _weight(n, k), _scale("row" if block is None else "block", n, k, block)
    bias = torch.randn(n)
    for m in (1, 8, 9, fp8.FUSED_MAX_ROWS, fp8.FUSED_MAX_ROWS + 1):
        x = torch.randn(m, k)
        torch.testing.assert_close(compute(x, w, scale, None, bias),
                                   torch.nn.functional.linear(x, _dense(w, scale, block), bias), **TOL)


@pytest.mark.parametrize("call, named", [
    (lambda w, s, x: cpu_fp8.fp8_linear(x.double(), w, s), "x must be"),
    (lambda w, s, x: cpu_fp8.fp8_linear(x, w.float(), s), "w must be a 2-D float8_e4m3fn"),
    (lambda w, s, x: cpu_fp8.fp8_linear(x, w.T, torch.tensor([1.0])), "w must be non-empty and contiguous"),
    (lambda w, s, x: cpu_fp8.fp8_linear(x[:, :7], w, s), "x's last dim 7 != w's K 20"),
    (lambda w, s, x: cpu_fp8.fp8_linear(x, w, s.double()), "scale must be a float32"),
    (lambda w, s, x: cpu_fp8.fp8_linear(x, w, torch.ones(5)), r"scale shape \(5,\) fits neither"),
    (lambda w, s, x: cpu_fp8.fp8_linear(x, w, torch.ones(1, 2), (4, 8)), r"block scale shape \(1, 2\) != \(3, 3\)"),
    (lambda w, s, x: cpu_fp8.fp8_linear(x, w, s, (4, 0)), r"block must be \(bn, bk\)"),
    (lambda w, s, x: cpu_fp8.fp8_linear(x, w, s, None, torch.ones(3)), r"bias must be a float CPU tensor \[12\]"),
    (lambda w, s, x: cpu_fp8.dequantize_rows(w, s, None, 4, 13), r"rows \[4, 13\) are outside w's 12 rows"),
])
def test_bad_arguments_are_named(call, named):
    with pytest.raises(ValueError, match=named):
        call(_weight(12, 20), torch.ones(12, 1), torch.randn(2, 20))


def test_the_torch_fallback_gives_the_same(monkeypatch):
    """RAYLLM_DISABLE_CPU_KERNEL=1: choose_compute keeps torch's tiles, which agree with the kernel."""
    n, k, block = 70, 200, (16, 64)
    w, scale = _weight(n, k), _scale("block", n, k, block)
    x, bias = torch.randn(5, k), torch.randn(n)
    expect = torch.nn.functional.linear(x, _dense(w, scale, block), bias)
    with_kernel = fp8.choose_compute(block, torch.device("cpu"), k, n)
    if cpu_fp8.available():
        torch.testing.assert_close(with_kernel(x, w, scale, None, bias), expect, **TOL)
    monkeypatch.setenv(cpu_build.DISABLE_ENV, "1")
    _forget_libraries()
    try:
        fallback = fp8.choose_compute(block, torch.device("cpu"), k, n)
        assert type(fallback) is fp8.WeightOnlyTiles
        torch.testing.assert_close(fallback(x, w, scale, None, bias), expect, **TOL)
        with pytest.raises(RuntimeError, match="unavailable"):
            cpu_fp8.fp8_linear(x, w, scale, block, bias)
    finally:
        monkeypatch.delenv(cpu_build.DISABLE_ENV)
        _forget_libraries()


def _forget_libraries():
    """Drop the loaded-library caches so the next use reads the environment again."""
    cpu_build.load_kernel_library.cache_clear()
    cpu_fp8._lib.cache_clear()
