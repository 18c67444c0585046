"""Draft-model speculation: greedy output equals HF's whatever the draft proposes, the draft's own KV
pool follows the target's sequences (chunked catch-up, preemption) and is all free at the end."""
import pytest

from engine import LLM, SamplingParams
from engine.tools.tiny_model import make_tiny_model
from tests.hf_reference import assert_matches, hf_greedy
from tests.test_spec_decode import MAX_TOKENS, _generate, _prompts


@pytest.fixture(scope="module")
def other_llama(tmp_path_factory):
    """Another random model with tiny_llama's tokenizer: a draft that rarely agrees with it."""
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny-llama-draft"), arch="llama", preset="tiny", seed=1,
                               num_hidden_layers=1))


@pytest.mark.parametrize("draft, knobs", [
    ("itself", {}),
    ("itself", {"max_num_batched_tokens": 48, "num_kv_blocks": 14}),  # chunked catch-up, preemption
    ("other", {}),
])
def test_greedy_equals_hf_with_a_draft_model(tiny_llama, other_llama, draft, knobs):
    spec = {"method": "draft_model", "model": tiny_llama if draft == "itself" else other_llama,
            "num_speculative_tokens": 3}
    llm = LLM(tiny_llama, dtype="float32", device="cpu", speculative_config=spec, **knobs)
    prompts = _prompts(llm.llm_engine.model_config.vocab_size)
    outs = _generate(llm, prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    for p, out in zip(prompts, outs):
        assert_matches(out.outputs[0].token_ids, hf_greedy(tiny_llama, p, MAX_TOKENS), f"{len(p)} tokens, {draft}")
    stats = llm.llm_engine.get_stats()
    assert stats["spec_decode_num_draft_tokens"] > 0
    if draft == "itself":  # the target's own greedy tokens: all accepted (up to rounding near-ties)
        assert stats["spec_decode_num_accepted_tokens"] >= 0.9 * stats["spec_decode_num_draft_tokens"]
    if "num_kv_blocks" in knobs:
        assert llm.llm_engine.scheduler.num_preemptions > 0
    llm.llm_engine.spec_decoder.proposer.block_manager.check_no_leak()
