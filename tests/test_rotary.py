"""engine.layers.rotary: every RoPE scaling against transformers' own ROPE_INIT_FUNCTIONS and rotary
modules (configs built with transformers' config classes, read by our ModelConfig), and greedy
tokens equal to HF on tiny checkpoints with linear, dynamic and yarn scaling."""
import json
import random
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from engine import LLM, SamplingParams
from engine.config import ModelConfig
from engine.layers.rotary import RotaryEmbedding, get_rope, rope_angles
from kernels import cpu_ops
from tests.hf_reference import assert_matches, hf_greedy

_SHAPE = dict(vocab_size=128, hidden_size=128, intermediate_size=64, num_hidden_layers=1,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
_LONG = dict(short_factor=[1.0 + 0.05 * i for i in range(12)], long_factor=[1.0 + 0.7 * i for i in range(12)])
# name -> (transformers config class, its kwargs): each type, and the variants real checkpoints use
CASES = {
    "linear": ("LlamaConfig", dict(rope_parameters=dict(rope_type="linear", factor=2.5, rope_theta=10000.0))),
    "dynamic": ("LlamaConfig", dict(rope_parameters=dict(rope_type="dynamic", factor=3.3, rope_theta=10000.0))),
    "llama3": ("LlamaConfig", dict(rope_parameters=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, rope_theta=500000.0,
        original_max_position_embeddings=64))),
    "yarn": ("Qwen2Config", dict(rope_parameters=dict(  # Qwen2.5 style: original = max
        rope_type="yarn", factor=4.0, rope_theta=1000000.0, original_max_position_embeddings=512))),
    "yarn-gpt-oss": ("LlamaConfig", dict(rope_parameters=dict(  # no truncation of the ramp
        rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False, rope_theta=150000.0,
        original_max_position_embeddings=64))),
    "yarn-mscale": ("LlamaConfig", dict(rope_parameters=dict(  # DeepSeek style attention factor
        rope_type="yarn", factor=40.0, mscale=1.0, mscale_all_dim=0.707, rope_theta=10000.0,
        original_max_position_embeddings=64))),
    "longrope-partial": ("Phi3Config", dict(  # Phi-4-mini style: 3/4 of each head rotates
        partial_rotary_factor=0.75, original_max_position_embeddings=128,
        rope_parameters=dict(rope_type="longrope", rope_theta=10000.0, **_LONG))),
}
POSITIONS = [0, 1, 7, 63, 64, 65, 127, 128, 129, 511, 512, 1000, 2047, 2559]


def _hf_config(name: str):
    cls, kw = CASES[name]
    arch = {"Phi3Config": "Phi3ForCausalLM", "Qwen2Config": "Qwen2ForCausalLM"}.get(cls, "LlamaForCausalLM")
    return getattr(transformers, cls)(**_SHAPE, **kw, architectures=[arch])


def _hf_seq_len(config, rope_type: str, p: int):
    """What HF's rotary hands ROPE_INIT_FUNCTIONS when position p is the newest token: dynamic
    keeps its init frequencies up to max_position_embeddings and then grows from the tensor
    max(position) + 1; longrope's choice reads it as an int."""
    if rope_type == "dynamic":
        return None if p < config.max_position_embeddings else torch.tensor(p + 1)
    return p + 1


@pytest.mark.parametrize("name", CASES)
def test_each_row_equals_hf_rope_init_functions(name):
    hf = _hf_config(name)
    ours = ModelConfig.from_hf_dict(hf.to_dict())
    rope_type = hf.rope_parameters["rope_type"]
    rotary_dim = int(ours.head_dim * ours.partial_rotary_factor)
    angles, attention_factor = rope_angles(ours.rope_scaling, ours.rope_theta, rotary_dim,
                                           ours.max_position_embeddings)
    table = get_rope(ours).cos_sin_cache
    for p in (p for p in POSITIONS if p < ours.max_position_embeddings):
        inv_freq, hf_attention = ROPE_INIT_FUNCTIONS[rope_type](hf, None, seq_len=_hf_seq_len(hf, rope_type, p))
        assert attention_factor == pytest.approx(hf_attention, rel=1e-12), p
        expected = torch.tensor(float(p)) * inv_freq  # HF: position_ids.float() * inv_freq
        # Bit for bit, except dynamic's grown bases: ours are one vectorised pow over all rows,
        # which may round the last bit otherwise than HF's pow of one base.
        tol = dict(rtol=1e-6, atol=1e-4) if rope_type == "dynamic" and p >= hf.max_position_embeddings else {}
        torch.testing.assert_close(angles[p], expected, **(tol or dict(rtol=0, atol=0)), msg=f"{name}: {p}")
        cos_sin = torch.cat([expected.cos() * hf_attention, expected.sin() * hf_attention])
        torch.testing.assert_close(table[p], cos_sin, **(tol or dict(rtol=0, atol=0)), msg=f"{name}: {p}")


def test_tables_cover_the_grown_context():
    """yarn serves original * factor positions, dynamic max * factor (vLLM's derived lengths);
    longrope and llama3 configs already name their long context."""
    lengths = {name: ModelConfig.from_hf_dict(_hf_config(name).to_dict()).max_position_embeddings for name in CASES}
    assert lengths == {"linear": 512, "dynamic": 1689, "llama3": 512, "yarn": 2048, "yarn-gpt-oss": 2048,
                       "yarn-mscale": 2560, "longrope-partial": 512}


@pytest.mark.parametrize("name,positions", [
    ("longrope-partial", list(range(100))),   # a prompt within the original context: short factors
    ("longrope-partial", [300]),              # a decode past it: long factors
    ("dynamic", list(range(40))),
    ("dynamic", [700]),                       # the NTK base grown for 701 tokens
    ("yarn-gpt-oss", list(range(300))),
])
def test_rotation_equals_hf_module(name, positions):
    """q and k rotated by our layer equal HF's rotary module + apply_rotary_pos_emb (Phi-3's: the
    partial one) for one forward at these positions, as HF's decode loop runs it."""
    hf = _hf_config(name)
    module = {"Phi3Config": transformers.models.phi3.modeling_phi3,
              "LlamaConfig": transformers.models.llama.modeling_llama}[CASES[name][0]]
    hf_rotary = (module.Phi3RotaryEmbedding if "Phi3" in CASES[name][0] else module.LlamaRotaryEmbedding)(hf)
    ours = get_rope(ModelConfig.from_hf_dict(hf.to_dict()))
    n, head_dim = len(positions), ours.head_dim
    q, k = torch.randn(n, 4, head_dim), torch.randn(n, 2, head_dim)
    pos = torch.tensor(positions)
    cos, sin = hf_rotary(q, pos[None])
    hf_q, hf_k = module.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    our_q, our_k = ours(pos, q.clone(), k.clone())
    atol = 5e-5 if name == "dynamic" and max(positions) >= hf.max_position_embeddings else 2e-6  # see above
    torch.testing.assert_close(our_q, hf_q[0].transpose(0, 1), rtol=0, atol=atol)
    torch.testing.assert_close(our_k, hf_k[0].transpose(0, 1), rtol=0, atol=atol)
    if ours.rotary_dim < head_dim:  # the pass-through features are untouched
        assert torch.equal(our_q[..., ours.rotary_dim:], q[..., ours.rotary_dim:])


def test_cpu_kernel_takes_whole_heads_and_scaled_tables(monkeypatch):
    """The fused C rotation runs for full-head RoPE (yarn's attention factor is in the table);
    partial RoPE takes the torch path on the rotated features only."""
    if not cpu_ops.rotary_applies(torch.zeros(1, 1, 8), torch.zeros(1, dtype=torch.int64), torch.zeros(4, 8)):
        pytest.skip("the CPU kernels are not built here")
    calls = []
    real = cpu_ops.rotary_neox_
    monkeypatch.setattr(cpu_ops, "rotary_neox_", lambda *a: (calls.append(1), real(*a)))
    yarn = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64)
    whole, partial = RotaryEmbedding(32, 256, 10000.0, yarn), RotaryEmbedding(32, 256, 10000.0, yarn, rotary_dim=16)
    pos = torch.tensor([0, 3, 200])
    qk = torch.randn(3, 6, 32)
    fused = whole(pos, qk.clone())[0]
    assert calls == [1]
    cos, sin = whole.cos_sin_cache[pos].unsqueeze(1).chunk(2, dim=-1)
    x1, x2 = qk.chunk(2, dim=-1)
    torch.testing.assert_close(fused, torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1), rtol=0, atol=1e-6)
    partial(pos, qk.clone())
    assert calls == [1]


def test_bad_rotary_dim_is_refused():
    with pytest.raises(ValueError, match="rotary_dim=6 must be even and in"):
        RotaryEmbedding(4, 16, 10000.0, rotary_dim=6)


# -- greedy tokens against HF on tiny checkpoints ----------------------------------------------

MAX_TOKENS = 24


def _rescaled(src: str, out: Path, **changes) -> str:
    """A copy of the tiny checkpoint `src` (same weights and tokenizer) with config.json changed
    (a None value removes the key)."""
    shutil.copytree(src, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(changes)
    (out / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}, indent=2))
    return str(out)


def _check(path: str, lens, **engine_kw):
    llm = LLM(path, dtype="float32", device="cpu", **engine_kw)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, llm.llm_engine.model_config.vocab_size) for _ in range(n)] for n in lens]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for p, out in zip(prompts, outs):
        assert_matches(out.outputs[0].token_ids, hf_greedy(path, p, MAX_TOKENS), f"prompt of {len(p)}")
    llm.llm_engine.block_manager.check_no_leak()
    return llm


def test_linear_scaling_in_transformers_4_form_equals_hf(tiny_llama, tmp_path):
    path = _rescaled(tiny_llama, tmp_path / "linear", rope_parameters=None,
                     rope_scaling={"type": "linear", "factor": 4.0})
    llm = _check(path, (5, 90, 300), max_num_batched_tokens=48)  # chunked prefill
    assert llm.llm_engine.model_config.rope_scaling == {"rope_type": "linear", "factor": 4.0}


def test_dynamic_ntk_equals_hf_past_the_original_length(tiny_qwen2, tmp_path):
    """Prompts inside max_position_embeddings (64) that generate past it: HF grows the base at
    each decode step past 64, as the table's rows do (prompts under 64: HF's cached model resets)."""
    path = _rescaled(tiny_qwen2, tmp_path / "dynamic", max_position_embeddings=64,
                     rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    llm = _check(path, (3, 45, 60))
    assert llm.llm_engine.config.max_model_len == 128


def test_yarn_equals_hf_beyond_the_original_length(tiny_qwen2, tmp_path):
    """Qwen2.5-style YaRN (factor 4 over 256 positions, attention factor 1.139), prompts past 256,
    with prefix-cache hits on the second run."""
    path = _rescaled(tiny_qwen2, tmp_path / "yarn", max_position_embeddings=256,
                     rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
                                      "rope_theta": 10000.0})
    llm = _check(path, (7, 300, 600))
    rng = random.Random(0)
    prompts = [[rng.randrange(3, llm.llm_engine.model_config.vocab_size) for _ in range(n)] for n in (7, 300, 600)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
    assert outs[2].num_cached_tokens >= 592
    for p, out in zip(prompts, outs):
        assert_matches(out.outputs[0].token_ids, hf_greedy(path, p, MAX_TOKENS), f"cached prompt of {len(p)}")
