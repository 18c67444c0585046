"""The CPU int8 W8A8 kernel (kernels.cpu_int8), with VNNI and with AMX tiles, against torch: per-token quantization as
engine/layers/quantization/int8.py's quantize_per_token then `torch._int_mm`, the int32 sums equal,
the scaled output equal too (the same fp32 operations in the same order); odd shapes, fp32 and bf16
activations, static and dynamic scales, zero rows, round-half-even, the +128 offset's correction;
the packed layout; bad arguments named."""
import ctypes
import platform
import shutil
from pathlib import Path

import pytest
import torch

from engine.layers.quantization.int8 import quantize_per_channel, quantize_per_token, quantize_static
from kernels import cpu_build, cpu_int8

needs_kernel = pytest.mark.skipif(not cpu_int8.available(), reason="no AVX-512 VNNI here, or no C compiler")
ISAS = ["vnni", pytest.param("amx", marks=pytest.mark.skipif(not cpu_int8.amx_available(), reason="no AMX here"))]
# (in, out): in not a multiple of 64 (nor of 4: a padded last group), out not a multiple of 16
# (a short last block; 200: three full panels of 64 outputs and a panel of one block).
SHAPES = [(96, 200), (70, 37), (1030, 16), (3, 5)]
ROWS = [1, 3, 17, 64, 257]  # 257: two chunks of 256 rows


def make_weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return quantize_per_channel(torch.randn(n, k, generator=gen) * k ** -0.5)


def make_x(rows: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, k, generator=gen) * 3).to(dtype)


def torch_reference(x, q, scale, input_scale):
    """The engine's torch path: (int32 sums, x scales, output in x's dtype)."""
    if input_scale is None:
        qx, x_scale = quantize_per_token(x)
    else:
        qx, x_scale = quantize_static(x, input_scale), input_scale.reshape(1, 1).expand(x.shape[0], 1)
    acc = torch._int_mm(qx, q.t())
    return acc, x_scale, (acc.float() * x_scale * scale).to(x.dtype)


@needs_kernel
@pytest.mark.parametrize("k, n", SHAPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("isa", ISAS)
def test_matches_quantize_then_int_mm(k, n, rows, dtype, static, isa):
    q, scale = make_weight(n, k, seed=k + n)
    x = make_x(rows, k, dtype, seed=rows)
    # A static scale that clips the largest inputs (|x| up to ~4 sigma of 3 against 127 * 0.06 = 7.6).
    input_scale = torch.tensor([0.06]) if static else None
    w = cpu_int8.pack_int8_vnni(q, scale)
    acc_ref, x_scale_ref, y_ref = torch_reference(x, q, scale, input_scale)

    acc, x_scale = cpu_int8.int8_matmul_s32_cpu(x, w, input_scale, isa=isa)
    assert acc.dtype == torch.int32 and torch.equal(acc, acc_ref)
    assert torch.equal(x_scale, x_scale_ref)

    y = cpu_int8.int8_linear_cpu(x, w, input_scale, isa=isa)
    assert y.dtype == dtype and y.shape == (rows, n)
    # Tolerance 0: the same int32 sums, then acc * x_scale * w_scale in fp32 in torch's order and
    # one rounding to x's dtype.
    torch.testing.assert_close(y, y_ref, atol=0, rtol=0)
    torch.testing.assert_close(y, cpu_int8.int8_linear_reference(x, q, scale, input_scale), atol=0, rtol=0)


@needs_kernel
def test_zero_rows_and_no_rows():
    """An all-zero row gets torch's floor scale 1e-10 and a zero output, its neighbours unaffected."""
    q, scale = make_weight(40, 96, seed=0)
    x = make_x(5, 96, torch.float32, seed=1)
    x[1] = 0
    x[4] = 0
    w = cpu_int8.pack_int8_vnni(q, scale)
    acc, x_scale = cpu_int8.int8_matmul_s32_cpu(x, w)
    assert torch.equal(acc[[1, 4]], torch.zeros(2, 40, dtype=torch.int32))
    assert x_scale[1].item() == x_scale[4].item() == torch.tensor(1e-10).item()
    y = cpu_int8.int8_linear_cpu(x, w)
    assert torch.equal(y[[1, 4]], torch.zeros(2, 40))
    torch.testing.assert_close(y, torch_reference(x, q, scale, None)[2], atol=0, rtol=0)
    assert cpu_int8.int8_linear_cpu(x[:0], w).shape == (0, 40)


@needs_kernel
def test_rounding_half_to_even_and_clipping():
    """Static scale 1 and the identity weight: the int32 output is the quantized row itself."""
    values = [0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, 127.5, 200.0, -300.0, 3.49, -3.51]
    x = torch.tensor([values + [0.0] * (16 - len(values))])
    w = cpu_int8.pack_int8_vnni(torch.eye(16, dtype=torch.int8), torch.ones(16))
    acc, _ = cpu_int8.int8_matmul_s32_cpu(x, w, torch.tensor([1.0]))
    assert acc[0, :len(values)].tolist() == [0, 2, 2, 0, -2, -2, 126, 127, 127, -127, 3, -4]


@needs_kernel
@pytest.mark.parametrize("isa", ISAS)
def test_quotients_a_few_ulps_from_half_integers_round_as_a_division(isa):
    """The kernel divides by the scale with a reciprocal and FMAs: x = (j + 0.5) * s moved 0-2 ulps
    either way, over scales of every magnitude, quantizes to torch's `round(x / s)` bytes, as do
    infinite inputs. Multiplying by the reciprocal alone misrounds some of these."""
    gen = torch.Generator().manual_seed(0)
    k = 64
    w = cpu_int8.pack_int8_vnni(torch.eye(k, dtype=torch.int8), torch.ones(k))  # acc = the quantized row
    for exponent in range(-28, 29, 4):
        s = torch.tensor([1.37 * 10.0 ** exponent], dtype=torch.float32)
        x = (torch.randint(-130, 130, (64, k), generator=gen).float() + 0.5) * s
        for step in (float("-inf"), float("inf")):
            moved = x
            for _ in range(3):
                acc, _ = cpu_int8.int8_matmul_s32_cpu(moved, w, s, isa=isa)
                assert torch.equal(acc, quantize_static(moved, s).int()), (s.item(), step)
                moved = torch.nextafter(moved, torch.full_like(moved, step))
    x = torch.tensor([[float("inf"), -float("inf")] + [1.0] * (k - 2)])
    acc, _ = cpu_int8.int8_matmul_s32_cpu(x, w, torch.tensor([0.25]), isa=isa)
    assert acc[0, :3].tolist() == [127, -127, 4]


@pytest.mark.skipif(not cpu_int8.amx_available(), reason="no AMX here")
@pytest.mark.parametrize("rows", [1, 17, 64, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("static", [False, True])
def test_the_gated_matmul_equals_the_matmul_then_silu_and_mul(rows, dtype, static):
    """int8_linear_silu_cpu computes the gate and up halves' tiles together and applies SiLU in
    the epilogue: bit for bit the two calls it replaces, rows in any number of 16-row tiles."""
    from kernels import cpu_ops

    q, scale = make_weight(2 * 48, 70, seed=rows)
    x = make_x(rows, 70, dtype, seed=rows + 1)
    w = cpu_int8.pack_int8_vnni(q, scale)
    input_scale = torch.tensor([0.06]) if static else None
    want = cpu_ops.silu_and_mul(cpu_int8.int8_linear_cpu(x, w, input_scale, isa="amx"))
    assert torch.equal(cpu_int8.int8_linear_silu_cpu(x, w, input_scale), want)
    with pytest.raises(ValueError, match="multiple of 32"):
        cpu_int8.int8_linear_silu_cpu(x, cpu_int8.pack_int8_vnni(*make_weight(48, 70, seed=0)))


@needs_kernel
def test_the_plus_128_offset_is_taken_back():
    """Weights of one sign: every output's correction 128 * sum_k w[n, k] is large, and a row of
    zeros (all 128 after the offset) must still give 0."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randint(1, 128, (33, 70), generator=gen, dtype=torch.int8)
    q[5] = -q[5]
    x = torch.randn(4, 70, generator=gen)
    x[2] = 0
    w = cpu_int8.pack_int8_vnni(q, torch.ones(33))
    assert int(w.comp.abs().min()) >= 128 * 70
    acc, _ = cpu_int8.int8_matmul_s32_cpu(x, w)
    assert torch.equal(acc, torch_reference(x, q, torch.ones(33), None)[0])
    assert not acc[2].any()


@needs_kernel
@pytest.mark.parametrize("isa", ISAS)
def test_bf16_outputs_in_the_denormal_range_round_as_torch(isa):
    """Weight scales of 1e-42 make fp32 outputs denormal: vcvtneps2bf16 would flush them to 0,
    so those vectors take the bit arithmetic and equal torch's .to(bfloat16), next to normal ones."""
    q, scale = make_weight(48, 64, seed=4)
    scale[:16] = 1e-42  # the first block's outputs are denormal, the others normal
    x = make_x(16, 64, torch.bfloat16, seed=5)
    w = cpu_int8.pack_int8_vnni(q, scale)
    y = cpu_int8.int8_linear_cpu(x, w, isa=isa)
    ref = torch_reference(x, q, scale, None)[2]
    assert (ref[:, :16] != 0).any() and (ref[:, :16].float().abs() < torch.finfo(torch.float32).tiny).all()
    assert torch.equal(y.view(torch.int16), ref.view(torch.int16))


@needs_kernel
def test_strided_rows_and_largest_sums():
    """Rows of x 300 floats apart; extreme weights and activations (every product 127 * 127)."""
    wide = torch.randn(6, 300)
    q = torch.full((20, 128), 127, dtype=torch.int8)
    q[::2] = -127
    x = wide[:, 10:138]
    x[0] = 5.0  # every input at its row's absmax: qx = 127
    w = cpu_int8.pack_int8_vnni(q, torch.rand(20) + 0.5)
    acc, _ = cpu_int8.int8_matmul_s32_cpu(x, w)
    assert acc[0, 0].item() == -127 * 127 * 128 and acc[0, 1].item() == 127 * 127 * 128
    torch.testing.assert_close(cpu_int8.int8_linear_cpu(x, w), torch_reference(x, q, w.scale, None)[2],
                               atol=0, rtol=0)


def test_the_packed_layout():
    """packed[b, g, l, j] = q[16 b + l, 4 g + j], zeros past N and past K (K padded to whole AMX
    tiles of 64 inputs); comp = 128 * row sums."""
    q, scale = make_weight(37, 70, seed=5)
    w = cpu_int8.pack_int8_vnni(q, scale[:, None])
    assert w.packed.shape == (3, 32, 16, 4) and w.shape == (37, 70)
    flat = w.packed.transpose(1, 2).reshape(48, 128)
    assert torch.equal(flat[:37, :70], q) and not flat[37:].any() and not flat[:, 70:].any()
    assert torch.equal(w.comp, q.sum(1, dtype=torch.int32) * 128)
    assert torch.equal(w.scale, scale)


@pytest.mark.parametrize("call, named", [
    (lambda w: cpu_int8.int8_linear_cpu(torch.randn(2, 64).half(), w), "x must be a 2-D float32 or bfloat16"),
    (lambda w: cpu_int8.int8_linear_cpu(torch.randn(2, 3, 64), w), r"got torch.float32 \(2, 3, 64\)"),
    (lambda w: cpu_int8.int8_linear_cpu(torch.randn(2, 72), w), "x has 72 input features; the weight has 64"),
    (lambda w: cpu_int8.int8_linear_cpu(torch.randn(2, 64), w, torch.tensor([0.1, 0.2])),
     r"input_scale must be one float32 CPU value or None; got torch.float32 \(2,\)"),
    (lambda w: cpu_int8.int8_linear_cpu(torch.randn(2, 64), w, torch.tensor([1], dtype=torch.float64)),
     "input_scale must .* got torch.float64"),
    (lambda w: cpu_int8.pack_int8_vnni(torch.zeros(16, 64, dtype=torch.uint8), torch.ones(16)),
     r"q must be a 2-D int8 CPU tensor \[N, K\]; got torch.uint8"),
    (lambda w: cpu_int8.pack_int8_vnni(torch.zeros(16, 64, dtype=torch.int8), torch.ones(15)),
     r"scale must be a float tensor of 16 entries .* \(15,\)"),
    (lambda w: cpu_int8.CpuInt8Weights(w.packed, w.comp.long(), w.scale, 64), "comp must .* got torch.int64"),
    (lambda w: cpu_int8.CpuInt8Weights(w.packed[:, :8], w.comp, w.scale, 64), r"packed must .* \(1, 16, 16, 4\)"),
    (lambda w: cpu_int8.CpuInt8Weights(w.packed, w.comp, w.scale, cpu_int8.MAX_K + 1),
     f"in_features must be in 1..{cpu_int8.MAX_K} .* got {cpu_int8.MAX_K + 1}"),
    (lambda w: cpu_int8.int8_linear_cpu(torch.randn(2, 64), w, isa="avx2"),
     r"isa must be one of \['amx', 'auto', 'vnni'\]; got 'avx2'"),
])
def test_bad_arguments_are_named(call, named):
    w = cpu_int8.pack_int8_vnni(*make_weight(16, 64, seed=0))
    with pytest.raises(ValueError, match=named):
        call(w)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or shutil.which("cc") is None,
                    reason="an x86 C compiler is needed to build without VNNI")
def test_a_build_without_vnni_says_so(tmp_path):
    """Built for a CPU without AVX-512 VNNI, the library reports it and refuses to multiply; the
    wrapper then calls the kernel unavailable, and the layers keep their torch path."""
    source = Path(cpu_int8.__file__).with_name("cpu_int8.c")
    target = tmp_path / "cpu_int8_novnni.so"
    assert cpu_build._compile("cc", source, target, ["-O1", "-march=native", "-mno-avx512vnni", "-shared",
                                                      "-fPIC"]) is None
    lib = ctypes.CDLL(str(target))
    assert lib.rayllm_int8_vnni_available() == 0
    assert lib.rayllm_int8_w8a8_gemm(*[None] * 14) == 1  # ERR_NO_VNNI, nothing touched


@needs_kernel
@pytest.mark.skipif(shutil.which("cc") is None, reason="a C compiler is needed to build without AMX")
def test_a_build_without_amx_multiplies_with_vnni(tmp_path):
    """Built for a CPU with VNNI but no AMX, the library says so, refuses isa="amx" (ERR_NO_AMX)
    and still multiplies on auto, with every row count."""
    source = Path(cpu_int8.__file__).with_name("cpu_int8.c")
    target = tmp_path / "cpu_int8_noamx.so"
    assert cpu_build._compile("cc", source, target, ["-O1", "-march=native", "-mno-amx-tile", "-mno-amx-int8",
                                                      "-shared", "-fPIC"]) is None
    lib = cpu_build.bind_signatures(ctypes.CDLL(str(target)), cpu_int8._SIGNATURES)
    assert lib.rayllm_int8_vnni_available() == 1 and lib.rayllm_int8_amx_available() == 0
    q, scale = make_weight(40, 96, seed=2)
    w = cpu_int8.pack_int8_vnni(q, scale)
    for rows, isa, expected in [(3, 0, 0), (64, 0, 0), (64, 2, 4)]:
        x = make_x(rows, 96, torch.float32, seed=rows)
        acc = torch.zeros(rows, 40, dtype=torch.int32)
        x_scale = torch.empty(rows)
        err = lib.rayllm_int8_w8a8_gemm(x.data_ptr(), rows, 96, 0, None, w.packed.data_ptr(), w.comp.data_ptr(),
                                        w.scale.data_ptr(), 96, 40, acc.data_ptr(), 3, x_scale.data_ptr(), isa)
        assert err == expected
        if not err:
            assert torch.equal(acc, torch_reference(x, q, scale, None)[0])


def test_unavailable_where_the_library_has_no_vnni(monkeypatch):
    class Fn:
        def __init__(self, result):
            self.result = result

        def __call__(self, *args):
            return self.result

    class NoVnniLibrary:
        rayllm_int8_vnni_available = Fn(0)
        rayllm_int8_amx_available = Fn(0)
        rayllm_int8_w8a8_gemm = Fn(1)
        rayllm_int8_w8a8_gemm_silu = Fn(1)

    monkeypatch.setattr(cpu_int8, "load_kernel_library", lambda name: NoVnniLibrary())
    cpu_int8._lib.cache_clear()
    try:
        assert not cpu_int8.available()
        with pytest.raises(RuntimeError, match="not available .* no AVX-512 VNNI"):
            cpu_int8.int8_linear_cpu(torch.randn(2, 64), cpu_int8.pack_int8_vnni(*make_weight(16, 64, seed=0)))
    finally:
        monkeypatch.undo()
        cpu_int8._lib.cache_clear()
