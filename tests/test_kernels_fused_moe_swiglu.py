"""The fused-MoE kernels with per-expert biases and gpt-oss's clamped SwiGLU (kernels/triton_fused_moe.py
under the interpreter on CPU, natively on a GPU; kernels/torch_fused_moe.py) against the dense
float64 oracle, and the activation itself against transformers' GptOssExperts._apply_gate."""
import pytest
import torch

from tests.triton_device import DEVICE  # before kernels: sets the interpreter up

from kernels.torch_fused_moe import ClampedSwiGLU, fused_moe_torch  # noqa: E402
from kernels.triton_fused_moe import fused_moe, fused_moe_ref  # noqa: E402

SMALL_TILES = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2)
# A limit the tiny activations reach, so both clamps bite.
SWIGLU = ClampedSwiGLU(alpha=1.702, limit=0.8)


def make_case(num_tokens, num_experts, top_k, hidden=32, inter=24, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=g)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden ** 0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=g) / inter ** 0.5
    b13 = 0.3 * torch.randn(num_experts, 2 * inter, generator=g)
    b2 = 0.3 * torch.randn(num_experts, hidden, generator=g)
    top_logits, ids = torch.randn(num_tokens, num_experts, generator=g).topk(top_k, dim=-1)
    to = dict(device=DEVICE, dtype=dtype)
    return ((x.to(**to), w13.to(**to), w2.to(**to), top_logits.softmax(-1).to(DEVICE), ids.to(DEVICE)),
            dict(b13=b13.to(**to), b2=b2.to(**to)))


def test_activation_equals_transformers_apply_gate():
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    experts = GptOssExperts(GptOssConfig(hidden_size=8, intermediate_size=6, num_local_experts=2,
                                         swiglu_limit=SWIGLU.limit))
    gate_up = 2 * torch.randn(5, 12, generator=torch.Generator().manual_seed(0))  # interleaved g u g u ...
    stacked = torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], dim=-1)  # [gate | up], as FusedMoE holds it
    assert (gate_up.abs() > SWIGLU.limit).float().mean() > 0.3
    torch.testing.assert_close(SWIGLU(stacked), experts._apply_gate(gate_up), atol=0, rtol=0)


@pytest.mark.parametrize("num_tokens, num_experts, top_k", [(1, 4, 2), (9, 6, 2), (21, 8, 4)])
@pytest.mark.parametrize("activation", [None, SWIGLU], ids=["silu", "clamped_swiglu"])
def test_triton_with_bias_matches_reference(num_tokens, num_experts, top_k, activation):
    args, bias = make_case(num_tokens, num_experts, top_k)
    out = fused_moe(*args, config=SMALL_TILES, activation=activation, **bias)
    ref = fused_moe_ref(*args, activation=activation, **bias)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(ref, fused_moe_ref(*args, activation=activation), atol=1e-2)  # the biases count


def test_triton_partial_tiles_and_bf16():
    args, bias = make_case(5, 3, 2, hidden=40, inter=20)  # K and N loops end on partial tiles
    torch.testing.assert_close(fused_moe(*args, config=SMALL_TILES, activation=SWIGLU, **bias),
                               fused_moe_ref(*args, activation=SWIGLU, **bias), atol=1e-4, rtol=1e-4)
    args, bias = make_case(12, 4, 2, dtype=torch.bfloat16)
    up = [t.float() if t.is_floating_point() else t for t in args]
    ref = fused_moe_ref(*up, activation=SWIGLU, **{k: v.float() for k, v in bias.items()})
    out = fused_moe(*args, config=SMALL_TILES, activation=SWIGLU, **bias)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_torch_path_with_bias_matches_reference(dtype):
    args, bias = make_case(17, 6, 2, dtype=dtype)
    args = tuple(t.cpu() for t in args)
    bias = {k: v.cpu() for k, v in bias.items()}
    up = [t.float() if t.is_floating_point() else t for t in args]
    ref = fused_moe_ref(*up, activation=SWIGLU, **{k: v.float() for k, v in bias.items()})
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(fused_moe_torch(*args, activation=SWIGLU, **bias).float(), ref, atol=tol, rtol=tol)


def test_bias_of_the_wrong_shape_is_named():
    args, bias = make_case(3, 4, 2)
    with pytest.raises(ValueError, match="b2"):
        fused_moe_torch(*[t.cpu() for t in args], b13=bias["b13"].cpu(), b2=bias["b2"].cpu()[:, :-1])
