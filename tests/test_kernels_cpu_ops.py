"""The CPU path's fused elementwise C ops (kernels.cpu_ops) against the torch code they replace."""
import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_ops
from kernels.reference import store_kv_ref
from engine.layers.rotary import RotaryEmbedding, _rotate_neox_

needs_ops = pytest.mark.skipif(cpu_ops._lib() is None, reason="the C ops could not be built here")
TOL = dict(atol=2e-6, rtol=2e-6)


@needs_ops
@pytest.mark.parametrize("rows, hidden", [(1, 512), (7, 96), (300, 520)])  # 520: a scalar tail
def test_add_rms_norm_with_residual(rows, hidden):
    x, residual, weight = torch.randn(rows, hidden), torch.randn(rows, hidden), torch.randn(hidden)
    total = x + residual
    ref = F.rms_norm(total, (hidden,), weight, 1e-6)
    out = cpu_ops.add_rms_norm(x, residual, weight, 1e-6)
    assert out is x  # written over the input, as RMSNorm's contract allows
    torch.testing.assert_close(out, ref, **TOL)
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
@pytest.mark.parametrize("rows, d", [(1, 1408), (33, 40), (2048, 24)])
def test_silu_and_mul(rows, d):
    x = torch.randn(rows, 2 * d) * 8  # large |gate| too: exp's range reduction on both sides
    ref = F.silu(x[:, :d]) * x[:, d:]
    torch.testing.assert_close(cpu_ops.silu_and_mul(x), ref, **TOL)


@needs_ops
@pytest.mark.parametrize("head_dim", [64, 80, 128])
def test_rotary_matches_the_torch_rotation(head_dim):
    rotary = RotaryEmbedding(head_dim, 512, 10000.0)
    qkv = torch.randn(9, 7 * head_dim)
    qk = qkv[:, :5 * head_dim].view(9, 5, head_dim)  # strided rows, as in the model
    positions = torch.randint(0, 512, (9,))
    expect = qk.clone()
    cos, sin = rotary.cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)
    _rotate_neox_(expect, cos, sin)
    assert cpu_ops.rotary_applies(qk, positions, rotary.cos_sin_cache)
    cpu_ops.rotary_neox_(qk, positions, rotary.cos_sin_cache)
    torch.testing.assert_close(qk, expect, **TOL)


@needs_ops
def test_store_kv_matches_reference_and_refuses_bad_slots():
    key, value = torch.randn(6, 2, 64), torch.randn(6, 2, 64)
    caches = [torch.zeros(3, 16, 2, 64) for _ in range(4)]
    slots = torch.tensor([5, -1, 47, 0, -1, 16])
    assert cpu_ops.store_kv(key, value, caches[0], caches[1], slots)
    store_kv_ref(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    with pytest.raises(ValueError, match="slot 48"):
        cpu_ops.store_kv(key, value, caches[0], caches[1], torch.tensor([0, 1, 2, 48, 3, 4]))
    assert torch.equal(caches[0], caches[2])  # a refused call writes nothing


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_other_dtypes_are_left_to_torch(dtype):
    x = torch.randn(4, 32, dtype=dtype)
    assert cpu_ops.add_rms_norm(x, None, torch.ones(32, dtype=dtype), 1e-6) is None
    assert cpu_ops.silu_and_mul(x) is None
    assert not cpu_ops.rotary_applies(x.view(4, 1, 32), torch.zeros(4, dtype=torch.long),
                                      torch.zeros(8, 32, dtype=dtype))
