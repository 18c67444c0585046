"""Mixture-of-experts: the FusedMoE layer's CPU path against the dense oracle, the loader's
expert mappings (per-expert and transformers 5's fused tensors), and Mixtral / Qwen2-MoE /
Qwen3-MoE token for token against HF transformers under every scheduling regime, at TP=2
equal to TP=1, and refusing what they do not run by name."""
import json
import shutil

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from engine import LLM
from engine.config import ModelConfig
from engine.executor.network_utils import free_port
from engine.layers.fused_moe import FusedMoE, select_experts
from engine.models import get_model_class
from engine.tools.tiny_model import make_tiny_model
from kernels.torch_fused_moe import fused_moe_torch
from kernels.triton_fused_moe import fused_moe_ref
from tests.test_llm import REGIMES, _check_against_hf, _prompts
from tests.test_models import load_our_model

ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe")
# Five prompts, 1081 tokens: over the 960 KV slots of the preemption regimes.
PROMPT_LENS = (1, 17, 130, 333, 600)
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    """arch -> path of its tiny checkpoint, built on first use (8 experts, top-2)."""
    built = {}

    def get(arch: str) -> str:
        if arch not in built:
            built[arch] = str(make_tiny_model(tmp_path_factory.mktemp(f"tiny-{arch}"), arch=arch, seed=0))
        return built[arch]
    return get


def _routing(num_tokens, num_experts, top_k, idle=(), seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, generator=g)
    logits[:, list(idle)] = float("-inf")
    return select_experts(logits, top_k, renormalize=True)


@pytest.mark.parametrize("num_tokens, idle", [(1, ()), (7, (0, 3)), (64, ())])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cpu_path_matches_dense_reference(num_tokens, idle, dtype):
    g = torch.Generator().manual_seed(1)
    hidden, inter, num_experts = 32, 24, 6
    x = torch.randn(num_tokens, hidden, generator=g).to(dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden ** 0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=g) / inter ** 0.5).to(dtype)
    weights, ids = _routing(num_tokens, num_experts, 2, idle)
    out = fused_moe_torch(x, w13, w2, weights, ids)
    ref = fused_moe_ref(x.float(), w13.float(), w2.float(), weights, ids)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


def test_routing_orders_agree_and_renormalise():
    logits = torch.randn(5, 8, generator=torch.Generator().manual_seed(2))
    w, ids = select_experts(logits, 2, renormalize=True)
    w_first, ids_first = select_experts(logits, 2, renormalize=True, softmax_first=False)
    assert torch.equal(ids, ids_first)
    torch.testing.assert_close(w, w_first)
    torch.testing.assert_close(w.sum(-1), torch.ones(5))
    raw, _ = select_experts(logits, 2, renormalize=False)
    torch.testing.assert_close(raw, logits.softmax(-1).topk(2).values)


def test_layer_loads_fused_tensors_and_runs_packed_on_cpu():
    g = torch.Generator().manual_seed(3)
    layer = FusedMoE(num_experts=4, top_k=2, hidden_size=16, intermediate_size=12, renormalize=False)
    w13, w2 = torch.randn(4, 24, 16, generator=g), torch.randn(4, 16, 12, generator=g)
    layer.weight_loader(layer.gate_up_proj, w13)  # shard id None: transformers 5's fused layout
    layer.weight_loader(layer.down_proj, w2)
    layer.process_weights_after_loading()
    assert layer.packed_experts is not None and len(layer.packed_experts) == 4  # oneDNN, as the runner packs linears
    for dense in (layer.gate_up_proj, layer.down_proj):  # freed, not held beside the packed copies
        assert dense.shape[0] == 4 and dense.untyped_storage().nbytes() == dense.element_size()
    x, logits = torch.randn(9, 16, generator=g), torch.randn(9, 4, generator=g)
    weights, ids = select_experts(logits, 2, renormalize=False)
    torch.testing.assert_close(layer(x, logits), fused_moe_ref(x, w13, w2, weights, ids), atol=1e-4, rtol=1e-4)


def test_layer_refuses_bad_expert_shards():
    layer = FusedMoE(num_experts=4, top_k=2, hidden_size=8, intermediate_size=6, renormalize=True)
    with pytest.raises(ValueError, match="expert 4 is out of range"):
        layer.weight_loader(layer.gate_up_proj, torch.zeros(6, 8), (4, 0))
    with pytest.raises(ValueError, match="shape"):
        layer.weight_loader(layer.down_proj, torch.zeros(8, 5), (0, None))
    with pytest.raises(ValueError, match="num_experts_per_tok=5"):
        FusedMoE(num_experts=4, top_k=5, hidden_size=8, intermediate_size=6, renormalize=True)


@pytest.mark.parametrize("regime", REGIMES)
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_equals_hf(tiny_moe, arch, regime):
    path = tiny_moe(arch)
    llm = LLM(path, dtype="float32", device="cpu", **REGIMES[regime])
    _check_against_hf(path, llm, _prompts(llm.llm_engine.model_config.vocab_size, PROMPT_LENS), MAX_TOKENS)
    if regime.endswith("preemption"):
        assert llm.llm_engine.scheduler.num_preemptions > 0, "the tiny cache should have forced preemption"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("regime", REGIMES)
@pytest.mark.parametrize("arch", ARCHS)
def test_cuda_greedy_equals_hf(tiny_moe, arch, regime):
    """The Triton fused-MoE kernel inside the engine (decode in CUDA graphs), fp32 against HF."""
    path = tiny_moe(arch)
    llm = LLM(path, dtype="float32", device="cuda", **REGIMES[regime])
    assert llm.llm_engine.executor.runner.graph_runner is not None
    _check_against_hf(path, llm, _prompts(llm.llm_engine.model_config.vocab_size, PROMPT_LENS), MAX_TOKENS)


def test_routing_spreads_tokens_and_layers_follow_the_config(tiny_moe):
    model = load_our_model(tiny_moe("qwen2_moe"))
    mlps = [type(layer.mlp).__name__ for layer in model.model.layers]
    assert mlps == ["Qwen2MoeSparseMoeBlock", "LlamaMLP"]  # mlp_only_layers=[1]
    block = model.model.layers[0].mlp
    x = torch.randn(64, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    _, ids = select_experts(block.gate(x), block.experts.top_k, block.experts.renormalize)
    assert ids.unique().numel() == block.experts.num_experts  # every expert is exercised


def _copy_checkpoint(src, dst, config_changes=None):
    shutil.copytree(src, dst)
    if config_changes:
        cfg = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**cfg, **config_changes}))
    return dst


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_fused_expert_tensors_load_like_per_expert_ones(tiny_moe, tmp_path, arch):
    """transformers 5's own layout ([E, 2I, H] gate_up_proj, [E, H, I] down_proj per layer, as its
    state_dict holds them; save_pretrained writes per-expert tensors) loads to the same weights."""
    path = tiny_moe(arch)
    fused = _copy_checkpoint(path, tmp_path / "fused")
    for f in fused.glob("*.safetensors"):
        f.unlink()
    state = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    assert any(name.endswith("mlp.experts.gate_up_proj") for name in state)
    save_file({k: v.contiguous() for k, v in state.items()}, fused / "model.safetensors")
    ours, from_fused = load_our_model(path).state_dict(), load_our_model(fused).state_dict()
    assert ours.keys() == from_fused.keys()
    for name, tensor in ours.items():
        assert torch.equal(tensor, from_fused[name]), name


def test_a_missing_expert_is_named(tiny_moe, tmp_path):
    path = tiny_moe("mixtral")
    broken = _copy_checkpoint(path, tmp_path / "broken")
    from safetensors.torch import load_file
    tensors = load_file(broken / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.5.w3.weight"]
    save_file(tensors, broken / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing weights \['model.layers.1.block_sparse_moe.experts.5.w3.weight'\]"):
        load_our_model(broken)


@pytest.mark.parametrize("arch, change, named", [
    ("qwen3_moe", {"scoring_func": "sigmoid"}, "scoring_func='sigmoid'"),
    ("qwen3_moe", {"shared_expert_intermediate_size": 64}, "shared_expert_intermediate_size=64"),
    ("mixtral", {"n_group": 4, "topk_group": 2}, "n_group=4"),
    ("qwen2_moe", {"num_experts_per_tok": 9}, "num_experts_per_tok=9"),
])
def test_unsupported_moe_features_fail_at_start(tiny_moe, tmp_path, arch, change, named):
    path = _copy_checkpoint(tiny_moe(arch), tmp_path / "ckpt", change)
    with pytest.raises(ValueError, match=named):
        LLM(str(path), dtype="float32", device="cpu")
    config = ModelConfig.from_pretrained(path)  # the model class refuses it before allocating weights
    with pytest.raises(ValueError, match=named):
        get_model_class(config.architecture)(config)


def test_tp2_logits_equal_tp1(tiny_moe, tmp_path):
    """Qwen2-MoE: routed experts, the shared expert and a dense layer, each sharded by its
    intermediate dim and all-reduced where a dense MLP reduces."""
    from tests.test_tensor_parallel import TP_SIZE, _run, _worker

    path = tiny_moe("qwen2_moe")
    mp.spawn(_worker, args=(free_port(), [path], tmp_path), nprocs=TP_SIZE, join=True)
    torch.testing.assert_close(torch.load(tmp_path / "logits0.pt"), _run(path), atol=1e-4, rtol=0)
