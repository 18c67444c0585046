"""Draft-model speculation: greedy output equals HF's whatever the draft proposes, the draft's own KV
pool follows the target's sequences (chunked catch-up, preemption) and is all free at the end;
sampled requests get drafts sampled from the draft's q, which keep the target's distribution, are
all accepted when the draft is the target, and keep a seeded request reproducible."""
import json
import math
import shutil

import pytest
import torch

from engine import LLM, SamplingParams
from engine.layers.linear import LinearBase
from engine.spec_decode import draft_model_proposer
from engine.tools.tiny_model import make_tiny_model
from tests.hf_reference import assert_matches, hf_greedy, load_hf
from tests.test_spec_decode import LETTERS, MAX_TOKENS, _generate, _prompts


@pytest.fixture(scope="module")
def other_llama(tmp_path_factory):
    """Another random model with tiny_llama's tokenizer: a draft that rarely agrees with it."""
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny-llama-draft"), arch="llama", preset="tiny", seed=1,
                               num_hidden_layers=1))


@pytest.mark.parametrize("draft, knobs", [
    ("itself", {}),
    ("itself", {"max_num_batched_tokens": 48, "num_kv_blocks": 14}),  # chunked catch-up, preemption
    ("other", {}),
    # Overlapped: accepted drafts wait for their step; rejected ones pause and those steps
    # overlap, after which the draft catches up on the tokens it did not see.
    ("itself", {"async_scheduling": True, "max_num_batched_tokens": 48, "num_kv_blocks": 14}),
    ("other", {"async_scheduling": True}),
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
    if knobs.get("async_scheduling"):
        assert llm.llm_engine.num_spec_waits > 0
    llm.llm_engine.spec_decoder.proposer.block_manager.check_no_leak()


def _draft_llm(target, draft, k=3):
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": k}
    return LLM(target, dtype="float32", device="cpu", speculative_config=spec)


# Sampled requests over 8 one-letter tokens at temperature 2: there the other draft's q shares about
# a third of its mass with the target's p, where a wrong acceptance test or residual shows most
# (of the temperatures and vocabularies tried, computed from the two models' distributions).
SAMPLED = {"temperature": 2.0, "ignore_eos": True, "allowed_token_ids": LETTERS[:8]}


def _draft_counts(llm, before=None):
    """(accepted, rejected) draft tokens since the stats `before` (None: since the start)."""
    after, before = llm.llm_engine.get_stats(), before or {}
    accepted = after["spec_decode_num_accepted_tokens"] - before.get("spec_decode_num_accepted_tokens", 0)
    drafted = after["spec_decode_num_draft_tokens"] - before.get("spec_decode_num_draft_tokens", 0)
    return accepted, drafted - accepted


def _letter_probs(path: str, contexts: list[list[int]], letters: list[int], temperature: float) -> torch.Tensor:
    """[len(contexts), len(letters)]: the distribution HF's model samples from after each context,
    restricted to `letters` (allowed_token_ids) at `temperature`."""
    with torch.inference_mode():
        logits = load_hf(path)(torch.tensor(contexts)).logits[:, -1, letters]
    return torch.softmax(logits / temperature, dim=-1)


def test_sampled_drafts_keep_the_distribution(tiny_llama, other_llama):
    """1200 completions with one sampled draft at their first decode: the token there (the draft
    accepted, or the residual's sample) is distributed as the target's p after the first token,
    as without speculation. The expected count of each letter is the sum of p(letter | first token)
    over the completions (Pearson's statistic is conservative with such a mixture; p > 1e-4; seeds
    are fixed, so the outcome is too). The draft's q has allowed_token_ids applied too. Accepting
    with p(d) instead of p(d) / q(d), or resampling from p (d taken out, or not) instead of
    max(0, p - q), fails it (tried: statistics of 125 to 164 against a limit of 30, and 5.6 as it is)."""
    llm = _draft_llm(tiny_llama, other_llama, k=1)
    prompt = [LETTERS[5]] * 24
    letters = SAMPLED["allowed_token_ids"]
    outs = _generate(llm, [prompt] * 6, SamplingParams(n=200, max_tokens=3, **SAMPLED))
    accepted, rejected = _draft_counts(llm)
    llm.shutdown()
    assert accepted >= 300 and rejected >= 300, (accepted, rejected)
    pairs = [(letters.index(c.token_ids[0]), letters.index(c.token_ids[1])) for o in outs for c in o.outputs]
    p = _letter_probs(tiny_llama, [prompt + [t] for t in letters], letters, SAMPLED["temperature"])
    expected = sum(p[first] for first, _ in pairs)  # [len(letters)]
    counts = torch.bincount(torch.tensor([second for _, second in pairs]), minlength=len(letters))
    stat = ((counts - expected) ** 2 / expected).sum().item()
    dof = len(letters) - 1
    z = 3.719  # 1 - 1e-4 quantile of N(0, 1); Wilson-Hilferty for the chi-squared quantile
    assert stat < dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3, (stat, counts, expected)


@pytest.mark.parametrize("drafts", ["sampled", "argmax"])
def test_a_draft_identical_to_the_target_is_accepted_nearly_always_when_sampled(tiny_llama, monkeypatch, drafts):
    """The target as its own draft, temperature 1 over the whole vocabulary: a draft drawn from q = p
    is accepted with probability p(d) / q(d) = 1 (up to rounding: k + 1 rows in one forward against
    one at a time). Argmax drafts (what greedy requests get) are accepted with p(argmax) only: 22% here."""
    if drafts == "argmax":  # what the proposer gives greedy requests, here for sampled ones too
        monkeypatch.setattr(draft_model_proposer, "_draft_params", lambda p: SamplingParams(temperature=0))
    llm = _draft_llm(tiny_llama, tiny_llama)
    prompts = _prompts(llm.llm_engine.model_config.vocab_size)
    before = llm.llm_engine.get_stats()
    _generate(llm, prompts, SamplingParams(n=4, temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    accepted, rejected = _draft_counts(llm, before)
    rate = accepted / (accepted + rejected)
    assert accepted + rejected >= 200
    assert rate >= 0.9 if drafts == "sampled" else rate <= 0.6, rate
    llm.shutdown()


def test_a_seeded_request_is_reproducible_with_sampled_drafts(tiny_llama, other_llama):
    """The draft samples a seeded request's drafts from a generator of its own (seeded apart from the
    target's), so its tokens are the same alone and beside unseeded requests, which draw from the
    draft's and the target's shared generators. (Drawing its drafts from the draft's shared
    generator fails this: tried.)"""
    llm = _draft_llm(tiny_llama, other_llama)
    prompt = [LETTERS[5]] * 24
    seeded = SamplingParams(seed=12, max_tokens=MAX_TOKENS, **SAMPLED)  # a seed whose drafts meet both outcomes
    other = SamplingParams(max_tokens=MAX_TOKENS, **SAMPLED)
    alone = _generate(llm, [prompt], seeded)[0].outputs[0].token_ids
    accepted, rejected = _draft_counts(llm)
    assert accepted > 0 and rejected > 0, (accepted, rejected)
    mixed = _generate(llm, [LETTERS[:12], prompt, prompt[7:]], [other, seeded, other])
    llm.shutdown()
    assert mixed[1].outputs[0].token_ids == alone


@pytest.mark.parametrize("draft", ["itself", "other"])  # drafts accepted / rejected
def test_tp2_target_with_a_whole_draft_on_rank_0(tiny_llama, other_llama, draft):
    """tensor_parallel_size=2 (gloo): the target sharded over two processes, the draft whole in rank
    0's. Greedy output equals HF's whether the drafts are accepted (the target as its own draft) or
    rejected and rolled back on both ranks (another model). Without `unsharded` the draft is built
    as half of a model and its forward waits in a collective that no worker joins."""
    spec = {"method": "draft_model", "model": tiny_llama if draft == "itself" else other_llama,
            "num_speculative_tokens": 3}
    with LLM(tiny_llama, dtype="float32", device="cpu", tensor_parallel_size=2, max_num_batched_tokens=64,
             speculative_config=spec) as llm:
        model = llm.llm_engine.spec_decoder.proposer.runner.model
        assert {m.tp_size for m in model.modules() if isinstance(m, LinearBase)} == {1}
        prompts = _prompts(llm.llm_engine.model_config.vocab_size)
        outs = _generate(llm, prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
        for p, out in zip(prompts, outs):
            assert_matches(out.outputs[0].token_ids, hf_greedy(tiny_llama, p, MAX_TOKENS), f"tp=2, {len(p)} tokens")
        accepted, rejected = _draft_counts(llm)
        assert (accepted if draft == "itself" else rejected) >= 30, (accepted, rejected)
        llm.llm_engine.spec_decoder.proposer.block_manager.check_no_leak()


def test_the_draft_holds_back_the_eos_ids_the_target_does(tiny_llama, tmp_path):
    """min_tokens keeps the engine's EOS ids out of p, the tokenizer's included when the model
    config names another; q must hold back the same ids, or a draft of the tokenizer's EOS is
    sampled where the target never can (lower acceptance)."""
    model = tmp_path / "other-eos"
    shutil.copytree(tiny_llama, model)
    for name in ("config.json", "generation_config.json"):
        config = json.loads((model / name).read_text())
        config["eos_token_id"] = 5
        (model / name).write_text(json.dumps(config))
    llm = _draft_llm(str(model), str(model))
    engine_eos = llm.llm_engine.eos_token_ids
    assert len(engine_eos) == 2 and 5 in engine_eos  # the config's and the tokenizer's
    assert llm.llm_engine.spec_decoder.proposer.sampler.sampler.eos_token_ids == engine_eos
    llm.shutdown()
