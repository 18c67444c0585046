"""Phi-3 (engine/models/phi3.py) against HF transformers, token for token, under every scheduling
regime: a tiny checkpoint with LongRoPE over an original context of 256 and partial rotary (3/4
of each head), prompts inside the original context and generations that cross into the long factors.
Phi-3-mini-4k's sliding window on the same model; TP=2 against TP=1 is a case of
tests/test_tensor_parallel.py."""
import pytest
import torch

from engine import LLM, SamplingParams
from engine.layers.linear import MergedColumnParallelLinear, QKVParallelLinear
from engine.tools.tiny_model import make_tiny_model
from tests.hf_reference import assert_matches, hf_greedy
from tests.test_llm import REGIMES, _prompts

# The tiny config's original context is 256: the 250-token prompt crosses it while generating,
# the 256-token one starts its generation past it.
PROMPT_LENS = [1, 17, 100, 250, 256]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def tiny_phi3(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny-phi3"), arch="phi3"))


@pytest.mark.parametrize("regime", REGIMES)
def test_greedy_equals_hf(tiny_phi3, regime):
    kw = dict(REGIMES[regime])
    if "num_kv_blocks" in kw:  # shorter prompts than test_llm's: a smaller cache still preempts
        kw["num_kv_blocks"] = 24
    llm = LLM(tiny_phi3, dtype="float32", device="cpu", **kw)
    config = llm.llm_engine.model_config
    assert (config.rope_scaling["rope_type"], config.partial_rotary_factor) == ("longrope", 0.75)
    prompts = _prompts(config.vocab_size, PROMPT_LENS)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.llm_engine.block_manager.check_no_leak()
    for p, out in zip(prompts, outs):
        assert_matches(out.outputs[0].token_ids, hf_greedy(tiny_phi3, p, MAX_TOKENS), f"prompt of {len(p)}")
    if regime.endswith("preemption"):
        assert llm.llm_engine.scheduler.num_preemptions > 0, "the tiny cache should have forced preemption"


def test_fused_checkpoint_tensors_split_into_their_parts():
    """shard_id None: the full model's [q | k | v] (or [gate | up]) rows, each part loaded as if it
    came alone; a fused tensor of the wrong size is refused naming the parts."""
    qkv = QKVParallelLinear(8, 2, total_num_heads=4, total_num_kv_heads=2)
    fused = torch.arange(16 * 8, dtype=torch.float32).reshape(16, 8)
    qkv.weight_loader(qkv.weight, fused)
    parts = QKVParallelLinear(8, 2, total_num_heads=4, total_num_kv_heads=2)
    for shard_id, rows in zip("qkv", fused.split([8, 4, 4])):
        parts.weight_loader(parts.weight, rows, shard_id)
    assert torch.equal(qkv.weight, parts.weight) and torch.equal(qkv.weight, fused)
    with pytest.raises(ValueError, match=r"fused checkpoint tensor has 15 rows, expected 8 \+ 4 \+ 4 \(q, k, v\)"):
        qkv.weight_loader(qkv.weight, fused[:15])
    gate_up = MergedColumnParallelLinear(8, [6, 6])
    with pytest.raises(ValueError, match=r"expected 6 \+ 6 \(0, 1\)"):
        gate_up.weight_loader(gate_up.weight, torch.zeros(10, 8))


def test_sliding_window_equals_hf(tmp_path):
    """Phi-3-mini-4k's sliding window (every layer) on the tiny model: a 48-token window, prompts
    several windows long, greedy tokens equal HF's, with chunked prefill."""
    path = str(make_tiny_model(tmp_path, arch="phi3", sliding_window=48))
    llm = LLM(path, dtype="float32", device="cpu", max_num_batched_tokens=64)
    assert [llm.llm_engine.model_config.layer_sliding_window(i) for i in range(2)] == [48, 48]
    prompts = _prompts(llm.llm_engine.model_config.vocab_size, [30, 160, 250])
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for p, out in zip(prompts, outs):
        assert_matches(out.outputs[0].token_ids, hf_greedy(path, p, MAX_TOKENS), f"prompt of {len(p)}")
