"""gpt-oss: a tiny random checkpoint written by transformers' GptOssForCausalLM (sliding and full
layers alternating with a window of 16, sinks, biased router and experts, a clamped SwiGLU whose
limit the tiny activations reach, yarn RoPE) token for token against HF under every scheduling
regime with prompts of up to 37 windows; an MXFP4-packed copy of its experts against HF on the
dequantized weights; MXFP4 dequantization against transformers'; TP=2 equal to TP=1."""
import json
import shutil

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.config import EngineConfig, ModelConfig
from engine.executor.network_utils import free_port
from engine.loader.mxfp4 import dequantize_mxfp4
from engine.tools.tiny_model import make_tiny_model
from tests.hf_reference import assert_matches, hf_greedy
from tests.test_llm import REGIMES, _check_against_hf, _prompts
from tests.test_models import load_our_model

# Five prompts, 1081 tokens: over the 960 KV slots of the preemption regimes.
PROMPT_LENS = (1, 17, 130, 333, 600)
MAX_TOKENS = 12
EXPERT_WEIGHTS = (".experts.gate_up_proj", ".experts.down_proj")
E2M1_MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


@pytest.fixture(scope="module")
def tiny_gpt_oss(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny-gpt-oss"), arch="gpt_oss", seed=0))


def test_config_and_modules(tiny_gpt_oss):
    config = ModelConfig.from_pretrained(tiny_gpt_oss)
    assert config.layer_types == ["sliding_attention", "full_attention"] and config.sliding_window == 16
    assert config.rope_scaling["rope_type"] == "yarn"
    model = load_our_model(tiny_gpt_oss)
    windows = [layer.self_attn.attn.sliding_window for layer in model.model.layers]
    assert windows == [16, None]
    mlp = model.model.layers[0].mlp
    assert mlp.router.bias is not None and mlp.experts.gate_up_proj_bias is not None
    assert mlp.experts.activation.limit == config.hf_config["swiglu_limit"]
    assert model.model.layers[1].self_attn.attn.sinks.abs().sum() > 0


@pytest.mark.parametrize("regime", REGIMES)
def test_greedy_equals_hf(tiny_gpt_oss, regime):
    llm = LLM(tiny_gpt_oss, dtype="float32", device="cpu", **REGIMES[regime])
    _check_against_hf(tiny_gpt_oss, llm, _prompts(llm.llm_engine.model_config.vocab_size, PROMPT_LENS), MAX_TOKENS)
    if regime.endswith("preemption"):
        assert llm.llm_engine.scheduler.num_preemptions > 0, "the tiny cache should have forced preemption"


def pack_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Our own packer (tests only): [..., N] -> blocks [..., N / 32, 16] uint8, scales [..., N / 32]
    uint8. Each block's scale is the smallest power of two that brings its largest value within
    E2M1's 6; values round to the nearest code, the low nibble first."""
    g = w.float().reshape(*w.shape[:-1], -1, 32)
    amax = g.abs().amax(-1, keepdim=True).clamp(min=2.0 ** -120)
    exponent = torch.ceil(torch.log2(amax / 6.0))
    scaled = g / torch.exp2(exponent)
    code = (scaled.abs().unsqueeze(-1) - E2M1_MAGNITUDES).abs().argmin(-1) | ((scaled < 0).long() << 3)
    blocks = (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8)
    return blocks, (exponent.squeeze(-1) + 127).to(torch.uint8)


def test_dequantize_equals_transformers_and_inverts_the_packer():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 10, 4, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(100, 150, (3, 10, 4), generator=g, dtype=torch.uint8)
    for dtype in (torch.bfloat16, torch.float32):
        ours = dequantize_mxfp4(blocks, scales, dtype)  # [E, out, in]; transformers' is [E, in, out]
        assert torch.equal(ours, convert_moe_packed_tensors(blocks, scales, dtype=dtype).transpose(1, 2))
    w = torch.randn(4, 8, 64, generator=g)
    back = dequantize_mxfp4(*pack_mxfp4(w), torch.float32)
    assert torch.equal(dequantize_mxfp4(*pack_mxfp4(back), torch.float32), back)  # exact on its own grid
    assert (back - w).abs().max() <= 0.25 * w.abs().amax()  # E2M1's coarsest step is 2 of 6
    with pytest.raises(ValueError, match="uint8"):
        dequantize_mxfp4(blocks.int(), scales, torch.float32)


@pytest.fixture(scope="module")
def mxfp4_checkpoints(tiny_gpt_oss, tmp_path_factory):
    """(the experts packed as MXFP4 as the hub's checkpoints name them, the same weights dequantized
    by transformers in its bf16 layout: HF's oracle)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    tensors = load_file(f"{tiny_gpt_oss}/model.safetensors")
    packed, dequantized = {}, {}
    for name, t in tensors.items():
        if not name.endswith(EXPERT_WEIGHTS):
            packed[name] = dequantized[name] = t
            continue
        blocks, scales = pack_mxfp4(t.transpose(1, 2))  # HF's [E, in, out] -> [E, out, in / 32, 16]
        packed[f"{name}_blocks"], packed[f"{name}_scales"] = blocks, scales
        dequantized[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    paths = []
    for kind, state in (("mxfp4", packed), ("dequantized", dequantized)):
        path = tmp_path_factory.mktemp(f"gpt-oss-{kind}")
        shutil.copytree(tiny_gpt_oss, path, dirs_exist_ok=True)
        save_file(state, path / "model.safetensors")
        if kind == "mxfp4":
            cfg = json.loads((path / "config.json").read_text())
            cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
                "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
            (path / "config.json").write_text(json.dumps(cfg))
        paths.append(str(path))
    return paths


@pytest.mark.parametrize("regime", ["default", "chunked_prefill"])
def test_mxfp4_checkpoint_equals_hf_on_the_dequantized_weights(mxfp4_checkpoints, regime):
    packed, dequantized = mxfp4_checkpoints
    llm = LLM(packed, dtype="float32", device="cpu", **REGIMES[regime])
    prompts = _prompts(llm.llm_engine.model_config.vocab_size, (17, 130))
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    ours = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    for p, out in zip(prompts, ours):
        assert_matches(out.outputs[0].token_ids, hf_greedy(dequantized, p, MAX_TOKENS), f"prompt of {len(p)} tokens")
    expert = load_our_model(packed).model.layers[0].mlp.experts
    assert torch.equal(expert.down_proj, load_our_model(dequantized).model.layers[0].mlp.experts.down_proj)


@pytest.mark.parametrize("quantization_config, named", [
    ({"quant_method": "awq", "bits": 4}, "quant_method='awq'"),
    ({"quant_method": "mxfp4", "group_size": 64}, "group_size"),
])
def test_other_quantization_is_refused_by_name(tiny_gpt_oss, tmp_path, quantization_config, named):
    path = shutil.copytree(tiny_gpt_oss, tmp_path / "ckpt")
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "quantization_config": quantization_config}))
    with pytest.raises(ValueError, match=named):  # the method at ModelConfig, its keys when the engine resolves
        EngineConfig(model=str(path), device="cpu").resolve(ModelConfig.from_pretrained(path))


def test_tp2_logits_equal_tp1(tiny_gpt_oss, tmp_path):
    """Heads and their sinks, the experts' intermediate dim and its gate/up biases split per rank;
    the down bias added once."""
    from tests.test_tensor_parallel import TP_SIZE, _run, _worker

    mp.spawn(_worker, args=(free_port(), [tiny_gpt_oss], tmp_path), nprocs=TP_SIZE, join=True)
    torch.testing.assert_close(torch.load(tmp_path / "logits0.pt"), _run(tiny_gpt_oss), atol=1e-4, rtol=0)
