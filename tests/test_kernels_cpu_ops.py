"""The CPU path's fused elementwise C ops (kernels.cpu_ops) against the torch code they replace.

In bf16 and fp16 the ops compute in fp32 and round where torch's ops in that dtype do, so
their results differ from torch's only where the two fp32 values (a few fp32 ulps apart:
other summation orders, our exp) straddle a rounding boundary: by one ulp of the dtype, at
most 2^-7 of the value in bf16 (8 significant bits) and 2^-10 in fp16, per rounding.
"""
import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_ops
from kernels.reference import store_kv_ref
from engine.layers.activation import SiluAndMul
from engine.layers.layernorm import GemmaRMSNorm, RMSNorm
from engine.layers.rotary import RotaryEmbedding, _rotate_neox_

needs_ops = pytest.mark.skipif(cpu_ops._lib() is None, reason="the C ops could not be built here")
TOL = dict(atol=2e-6, rtol=2e-6)
ULP = {torch.float32: 0.0, torch.bfloat16: 2**-7, torch.float16: 2**-10}  # relative, at most
DTYPES = list(ULP)


def assert_matches(out, ref, roundings=1):
    """fp32: within TOL. A half type: within `roundings` ulps (each of torch's roundings may flip
    one), and equal but for a few elements: rounding where torch does not (or not where it does)
    would change about a quarter of them, a flip between two fp32 values ulps apart ~1e-4."""
    if ref.dtype == torch.float32:
        torch.testing.assert_close(out, ref, **TOL)
        return
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=roundings * ULP[ref.dtype])
    assert (out != ref).float().mean() < 0.01


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(0)  # the half-type cases count differing elements: the same inputs every run


@needs_ops
@pytest.mark.parametrize("dtype, weight_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                 (torch.bfloat16, torch.float32), (torch.float16, torch.float16),
                                                 (torch.float16, torch.float32)])
@pytest.mark.parametrize("rows, hidden", [(1, 512), (7, 96), (300, 520)])  # 520: a scalar tail
def test_add_rms_norm_with_residual(rows, hidden, dtype, weight_dtype):
    x, residual = torch.randn(rows, hidden).to(dtype), torch.randn(rows, hidden).to(dtype)
    weight = torch.randn(hidden).to(weight_dtype)
    total = x + residual  # rounded to dtype, as the layer's torch path adds
    # The torch forms the op stands in for: F.rms_norm with a weight of x's dtype (RMSNorm), and
    # GemmaRMSNorm's float32 formula with a float32 weight; both round once at the end.
    t32 = total.float()
    ref = (F.rms_norm(total, (hidden,), weight, 1e-6) if weight_dtype == dtype else
           (t32 * torch.rsqrt(t32.pow(2).mean(-1, keepdim=True) + 1e-6) * weight).to(dtype))
    out = cpu_ops.add_rms_norm(x, residual, weight, 1e-6)
    assert out is x  # written over the input, as RMSNorm's contract allows
    assert_matches(out, ref)
    torch.testing.assert_close(residual, total, atol=0, rtol=0)  # the new residual, in place


@needs_ops
def test_rms_norm_of_a_strided_view_leaves_the_input():
    base = torch.randn(5, 3 * 64)
    x = base[:, 64:128]  # rows 192 floats apart
    before = base.clone()
    out = cpu_ops.add_rms_norm(x, None, torch.ones(64), 1e-5)
    torch.testing.assert_close(out, F.rms_norm(x, (64,), torch.ones(64), 1e-5), **TOL)
    assert torch.equal(base, before)


@needs_ops
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, d", [(1, 1408), (33, 40), (2048, 24)])
def test_silu_and_mul(rows, d, dtype):
    x = (torch.randn(rows, 2 * d) * 8).to(dtype)  # large |gate| too: exp's range reduction on both sides
    ref = F.silu(x[:, :d]).mul_(x[:, d:])  # in a half type: silu rounded, then the product
    assert_matches(cpu_ops.silu_and_mul(x), ref, roundings=2)


@needs_ops
def test_bf16_results_in_the_denormal_range_and_nans_round_as_torch():
    """Products in fp32's denormal range, and NaNs: AVX512-BF16's rounding instruction would
    flush the first to zero and quiet the second its own way, so those vectors round bit by bit."""
    gate = torch.full((2, 64), 1e-20)
    up = torch.full((2, 64), 1e-19)  # silu(1e-20) * 1e-19 ~ 5e-40: denormal
    gate[1, 40] = float("nan")
    x = torch.cat([gate, up], 1).bfloat16()
    out, ref = cpu_ops.silu_and_mul(x), F.silu(x[:, :64]).mul_(x[:, 64:])
    assert ref[0, 0] != 0 and ref[0, 0].float().abs() < torch.finfo(torch.float32).tiny
    assert torch.equal(out.isnan(), ref.isnan())
    torch.testing.assert_close(out, ref, atol=0, rtol=0, equal_nan=True)
    weight = torch.full((64,), 1e-38).bfloat16()  # rms_norm(x) * weight: denormal outputs
    y = torch.randn(3, 64).bfloat16()
    ref = F.rms_norm(y, (64,), weight, 1e-6)
    assert (ref != 0).float().mean() > 0.9  # flushed to zero, they would all be 0
    torch.testing.assert_close(cpu_ops.add_rms_norm(y.clone(), None, weight, 1e-6), ref, atol=0, rtol=ULP[ref.dtype])


@needs_ops
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_layers_in_half_types_match_their_torch_path(dtype, monkeypatch):
    """RMSNorm (own weight dtype, and a float32 weight, which the C op must leave to torch: HF
    casts before that multiply), GemmaRMSNorm and SiluAndMul, with the C ops and without."""
    norm, gemma, wide = RMSNorm(96).to(dtype), GemmaRMSNorm(96).to(dtype), RMSNorm(96)
    for layer in (norm, gemma, wide):
        layer.weight.data.normal_()
    gemma.process_weights_after_loading()
    x, residual = torch.randn(5, 96).to(dtype), torch.randn(5, 96).to(dtype)
    gate_up = torch.randn(5, 2 * 40).to(dtype)

    def run():
        outs = [SiluAndMul()(gate_up)]
        for layer in (norm, gemma, wide):
            outs += [layer(x.clone()), *layer(x.clone(), residual.clone())]
        return outs

    fused = run()
    monkeypatch.setattr(cpu_ops, "_lib", lambda: None)
    for got, want in zip(fused, run()):
        assert got.dtype == want.dtype
        assert_matches(got, want, roundings=2)


@needs_ops
@pytest.mark.parametrize("head_dim", [64, 80, 128, 40])  # 80 and 40: a tail past the last CHUNK
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_matches_the_torch_rotation(head_dim, dtype):
    """fp32 within TOL; in a half type bit for bit: cos and sin rounded to it, and every
    product, difference and sum rounded where the layer's torch ops round them."""
    rotary = RotaryEmbedding(head_dim, 512, 10000.0)
    qkv = (torch.randn(33, 7 * head_dim) * 4).to(dtype)
    qk = qkv[:, :5 * head_dim].view(33, 5, head_dim)  # strided rows, as in the model
    positions = torch.randint(0, 512, (33,))
    expect, v = qk.clone(), qkv[:, 5 * head_dim:].clone()
    cos, sin = rotary.cos_sin_cache[positions].to(dtype).unsqueeze(1).chunk(2, dim=-1)
    _rotate_neox_(expect, cos, sin)
    assert cpu_ops.rotary_applies(qk, positions, rotary.cos_sin_cache)
    cpu_ops.rotary_neox_(qk, positions, rotary.cos_sin_cache)
    if dtype == torch.float32:
        torch.testing.assert_close(qk, expect, **TOL)
    else:
        assert torch.equal(qk.view(torch.int16), expect.view(torch.int16))
    assert torch.equal(qkv[:, 5 * head_dim:], v)  # the rows' other columns untouched


@needs_ops
@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_matches_reference_and_refuses_bad_slots(dtype):
    key, value = torch.randn(6, 2, 64).to(dtype), torch.randn(6, 2, 64).to(dtype)
    caches = [torch.zeros(3, 16, 2, 64, dtype=dtype) for _ in range(4)]
    slots = torch.tensor([5, -1, 47, 0, -1, 16])
    assert cpu_ops.store_kv(key, value, caches[0], caches[1], slots)
    store_kv_ref(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    with pytest.raises(ValueError, match="slot 48"):
        cpu_ops.store_kv(key, value, caches[0], caches[1], torch.tensor([0, 1, 2, 48, 3, 4]))
    assert torch.equal(caches[0], caches[2])  # a refused call writes nothing


def test_other_dtypes_are_left_to_torch():
    x = torch.randn(4, 32, dtype=torch.float64)
    assert cpu_ops.add_rms_norm(x, None, torch.ones(32, dtype=torch.float64), 1e-6) is None
    assert cpu_ops.silu_and_mul(x) is None
    half = torch.randn(4, 32, dtype=torch.bfloat16)
    assert cpu_ops.add_rms_norm(half, None, torch.ones(32, dtype=torch.float16), 1e-6) is None
    positions = torch.zeros(4, dtype=torch.long)
    assert not cpu_ops.rotary_applies(x.view(4, 1, 32), positions, torch.zeros(8, 32, dtype=torch.float64))
    for table in (torch.float16, torch.bfloat16):  # rotary's cos/sin table is fp32 only
        assert not cpu_ops.rotary_applies(half.view(4, 1, 32), positions, torch.zeros(8, 32, dtype=table))
