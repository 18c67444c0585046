"""Speculative decoding through the engine (n-gram drafts): the same greedy tokens as HF and as
decoding one token at a time, in every scheduling regime, with every sampling feature; sampled
tokens keep their distribution; KV blocks all come back. And SpecDecoder hands each step the q
of exactly the drafts it schedules.

Each test checks the counters: one whose drafts were all rejected would prove nothing. A tiny
random model copies nothing, and its greedy text wanders, so against HF (the prompts followed by
HF's own greedy output, which repeats itself in places) most drafts are rejected and a few
accepted; where a test needs long accepted runs, its requests write only the 16 one-letter tokens
(`LETTERS`, allowed_token_ids), over which the greedy text soon cycles and drafts are accepted."""
import dataclasses
import json
import math
import random

import pytest
import torch

from engine import LLM, SamplingParams, StructuredOutputsParams
from engine.core.block_manager import BlockManager
from engine.core.messages import ModelRunnerOutput, SchedulerOutput
from engine.core.scheduler import Scheduler
from engine.core.sequence import Sequence
from engine.spec_decode.spec_decoder import SpecDecoder
from tests.hf_reference import assert_matches, hf_greedy, load_hf

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
MAX_TOKENS = 24
LONG = 64
LETTERS = list(range(40, 56))  # one-letter tokens of the tiny tokenizers ("G", "I", ...)


def _prompts(vocab: int) -> list[list[int]]:
    """Random text, and text that repeats its spans (an edit or extraction copies its input)."""
    rng = random.Random(3)

    def span(n):
        return [rng.randrange(vocab) for _ in range(n)]
    a, b = span(12), span(30)
    return [span(5), a * 3, span(40) + b + span(7) + b[:10], (span(17) * 8)[:130]]


def _generate(llm, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.llm_engine.block_manager.check_no_leak()
    return outs


def _accepted(llm) -> int:
    stats = llm.llm_engine.get_stats()
    assert stats["spec_decode_num_draft_tokens"] >= stats["spec_decode_num_accepted_tokens"]
    return stats["spec_decode_num_accepted_tokens"]


REGIMES = {
    "whole_prefill_then_prefix_hit": {},
    "chunked_prefill": {"max_num_batched_tokens": 48},
    "preemption": {"num_kv_blocks": 11, "max_num_batched_tokens": 256},  # (the prompts alone: they fit)
}


@pytest.mark.parametrize("regime", REGIMES)
@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen2", "tiny_qwen3"])
def test_greedy_equals_hf(arch, regime, request):
    path = request.getfixturevalue(arch)
    llm = LLM(path, dtype="float32", device="cpu", speculative_config=NGRAM, **REGIMES[regime])
    prompts = _prompts(llm.llm_engine.model_config.vocab_size)
    if regime != "preemption":  # each followed by HF's greedy output for it, which repeats itself in places
        prompts = [p + hf_greedy(path, p, LONG).token_ids for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for attempt in range(2 if regime.endswith("prefix_hit") else 1):
        outs = _generate(llm, prompts, params)
        for p, out in zip(prompts, outs):
            assert_matches(out.outputs[0].token_ids, hf_greedy(path, p, MAX_TOKENS), f"{len(p)} tokens, {regime}")
    assert _accepted(llm) > 0
    if regime.endswith("prefix_hit"):
        assert outs[-1].num_cached_tokens >= 176, "the second run should have hit the prefix cache"
    if regime == "preemption":
        assert llm.llm_engine.scheduler.num_preemptions > 0, "the tiny cache should have forced preemption"


def test_greedy_equals_hf_prompt_lookup_generate(tiny_qwen2):
    """HF's own n-gram speculation (`prompt_lookup_num_tokens`), EOS left on, against ours."""
    llm = LLM(tiny_qwen2, dtype="float32", device="cpu", speculative_config=NGRAM)
    prompts = _prompts(llm.llm_engine.model_config.vocab_size)[1:3]
    outs = _generate(llm, prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    model = load_hf(tiny_qwen2)
    for p, out in zip(prompts, outs):
        with torch.inference_mode():
            hf = model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=MAX_TOKENS,
                                prompt_lookup_num_tokens=NGRAM["num_speculative_tokens"])
        assert out.outputs[0].token_ids == hf[0, len(p):].tolist()
    assert _accepted(llm) > 0


@pytest.fixture(scope="module")
def engines(tiny_llama):
    """The same model with and without speculation (one of each for the module)."""
    spec = LLM(tiny_llama, dtype="float32", device="cpu", speculative_config=NGRAM)
    plain = LLM(tiny_llama, dtype="float32", device="cpu")
    yield spec, plain
    spec.shutdown()
    plain.shutdown()


def _feature_requests(prompts):
    """Greedy requests over LETTERS, each with one feature that reads the output so far."""
    tokens = LETTERS[::3]
    greedy = dict(temperature=0, max_tokens=MAX_TOKENS, allowed_token_ids=LETTERS)
    params = [
        SamplingParams(**greedy, ignore_eos=True, logprobs=3),
        SamplingParams(**greedy, ignore_eos=True, repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.2),
        SamplingParams(**greedy, ignore_eos=True, n=2, logit_bias={tokens[0]: 2.0, tokens[1]: -1.0}),
        SamplingParams(**greedy, min_tokens=6, stop_token_ids=tokens[2:4]),
        SamplingParams(**greedy, ignore_eos=True, bad_words=["P"]),
    ]
    return prompts + [prompts[3]], params


def _same(got, want):
    """Tokens, text and finish state exactly; logprobs to 1e-4 (k + 1 rows in one forward round
    differently from one row at a time)."""
    for g, w in zip(got, want):
        assert [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in g.outputs] == \
            [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in w.outputs]
        for gc, wc in zip(g.outputs, w.outputs):
            assert (gc.logprobs is None) == (wc.logprobs is None)
            for gl, wl in zip(gc.logprobs or (), wc.logprobs or ()):
                assert list(gl) == list(wl)
                assert [v.logprob for v in gl.values()] == pytest.approx([v.logprob for v in wl.values()], abs=1e-4)


def test_sampling_features_equal_decoding_one_token_at_a_time(engines):
    """Penalties, logit_bias, allowed_token_ids, bad_words, min_tokens and stop tokens, n > 1 and
    logprobs see the accepted drafts as output, exactly as tokens decoded one by one."""
    spec, plain = engines
    prompts, params = _feature_requests(_prompts(spec.llm_engine.model_config.vocab_size))
    before = _accepted(spec)
    _same(_generate(spec, prompts, params), _generate(plain, prompts, params))
    assert _accepted(spec) - before >= 20


def test_stop_strings_and_max_tokens_inside_accepted_drafts(engines):
    """A stop string or max_tokens reached in the middle of a step's accepted drafts ends the
    output there: the tokens after it are dropped, as if decoded one at a time."""
    spec, plain = engines
    prompts = _prompts(spec.llm_engine.model_config.vocab_size)
    greedy = dict(temperature=0, ignore_eos=True, allowed_token_ids=LETTERS)
    fulls = _generate(plain, prompts, SamplingParams(**greedy, max_tokens=40))
    requests = [(p, SamplingParams(**greedy, max_tokens=40, stop=[f.outputs[0].text[i:i + n]]))
                for p, f in zip(prompts, fulls) for i, n in ((2, 2), (5, 3), (9, 1), (12, 4))]
    requests += [(prompts[m % 4], SamplingParams(**greedy, max_tokens=m)) for m in range(2, 14)]
    prompts, params = [p for p, _ in requests], [sp for _, sp in requests]
    before = _accepted(spec)
    got = _generate(spec, prompts, params)
    _same(got, _generate(plain, prompts, params))
    assert [len(o.outputs[0].token_ids) for o in got[16:]] == list(range(2, 14))
    assert all(o.outputs[0].finish_reason == "stop" for o in got[:16])
    assert _accepted(spec) - before >= 20


def test_seeded_sampling_is_reproducible_with_speculation(engines):
    spec, _ = engines
    prompt = _prompts(spec.llm_engine.model_config.vocab_size)[3]
    seeded = SamplingParams(temperature=0.5, seed=11, max_tokens=MAX_TOKENS, ignore_eos=True, allowed_token_ids=LETTERS)
    other = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    before = _accepted(spec)
    alone = _generate(spec, [prompt], seeded)[0].outputs[0].token_ids
    assert _accepted(spec) > before
    mixed = _generate(spec, [prompt[:50], prompt, prompt[7:]], [other, seeded, other])[1].outputs[0].token_ids
    assert alone == mixed


def _two_sample_chi2(a: list[int], b: list[int]) -> tuple[float, int]:
    """Chi-squared statistic and degrees of freedom of "a and b come from one distribution"."""
    values = sorted(set(a) | set(b))
    stat = 0.0
    for v in values:
        ca, cb = a.count(v), b.count(v)
        pooled = (ca + cb) / (len(a) + len(b))
        for count, n in ((ca, len(a)), (cb, len(b))):
            stat += (count - n * pooled) ** 2 / (n * pooled)
    return stat, len(values) - 1


def test_sampled_tokens_keep_their_distribution(engines):
    """Temperature sampling over the 16 LETTERS, 800 completions with speculation and 800 without:
    at each output position the tokens pass a chi-squared test of one distribution (p > 1e-4;
    seeds are fixed, so the outcome is too). The prompt repeats one letter: after that letter
    (its most likely first token) the draft is that letter again, accepted with its probability
    and rejected often, so every verified position depends on the resampling step: without it (a
    rejected draft redrawn from p itself) this test fails (tried)."""
    spec, plain = engines
    prompt = [LETTERS[5]] * 24
    params = SamplingParams(n=100, temperature=1.0, max_tokens=4, ignore_eos=True, allowed_token_ids=LETTERS)
    before = spec.llm_engine.get_stats()
    with_spec = _generate(spec, [prompt] * 8, params)
    without = _generate(plain, [prompt] * 8, params)
    after = spec.llm_engine.get_stats()
    accepted = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
    rejected = after["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"] - accepted
    assert accepted >= 200 and rejected >= 200, (accepted, rejected)
    for position in range(1, 4):
        a = [c.token_ids[position] for o in with_spec for c in o.outputs]
        b = [c.token_ids[position] for o in without for c in o.outputs]
        stat, dof = _two_sample_chi2(a, b)
        z = 3.719  # 1 - 1e-4 quantile of N(0, 1); Wilson-Hilferty for the chi-squared quantile
        assert stat < dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3, (position, stat, dof)


def test_metrics_count_drafts_and_accepted_positions(engines):
    spec, _ = engines
    stats = spec.llm_engine.get_stats()
    per_pos = [stats[f"spec_decode_num_accepted_tokens_per_pos_{i}"] for i in range(NGRAM["num_speculative_tokens"])]
    assert sum(per_pos) == stats["spec_decode_num_accepted_tokens"] > 0
    assert per_pos == sorted(per_pos, reverse=True)  # position i is accepted only after 0 .. i - 1
    assert stats["spec_decode_num_drafts"] <= stats["spec_decode_num_draft_tokens"] \
        <= NGRAM["num_speculative_tokens"] * stats["spec_decode_num_drafts"]
    assert dataclasses.asdict(spec.llm_engine.config.speculative_config)["method"] == "ngram"


def test_json_outputs_parse_and_validate_with_speculation(engines):
    """Grammar and speculation: drafts (copied from the example in the prompt) are cut where the
    grammar refuses them and verified against the grammar's mask at each position, the matcher
    follows the accepted tokens only. 20 seeds: every output parses and validates."""
    import jsonschema

    spec, _ = engines
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["name", "n"], "additionalProperties": False}
    prompt = 'Copy it: {"name": "abc", "n": 12} {"name": "abc", "n": 12} {"name": "abc", "n": 12}'
    json_form = StructuredOutputsParams(json=schema)
    params = [SamplingParams(temperature=0.8, seed=seed, max_tokens=64, structured_outputs=json_form)
              for seed in range(20)]
    before = _accepted(spec)
    outs = spec.generate([prompt] * len(params), params, use_tqdm=False)
    spec.llm_engine.block_manager.check_no_leak()
    for out in outs:
        assert out.outputs[0].finish_reason == "stop", out.outputs[0]
        jsonschema.validate(json.loads(out.outputs[0].text), schema)
    assert _accepted(spec) > before


class _ProposerWithQ:
    """Drafts and q chosen by the test, handed out as the draft model's sampled drafts are."""

    def __init__(self, drafts: dict[int, list[int]], probs: dict[int, torch.Tensor]):
        self.drafts, self.probs = drafts, probs

    def propose(self, seqs):
        return [self.drafts[seq.seq_id] for seq in seqs]

    def take_draft_probs(self):
        probs, self.probs = self.probs, {}
        return probs

    def retain(self, seq_ids):
        pass


class _CutAfterOne:
    """A grammar matcher that refuses every draft token after the first."""

    def draft_prefix(self, draft):
        return 1


def test_the_step_gets_q_rows_of_exactly_its_scheduled_drafts():
    """SpecDecoder attaches q to the scheduled step (SchedulerOutput.spec_draft_probs) after the
    scheduler's cut: "a" may verify 2 of its 4 drafts (max_tokens), so it gets q's first 2 rows; "b",
    whose grammar cut its draft, and "c", whose draft has no q (n-gram, argmax), get none. q belongs
    to one proposal: a step scheduled without a new proposal gets none."""
    sched = Scheduler(8, 64, 64, BlockManager(16, 4), eos_token_ids=[0])
    seqs = [Sequence(rid, [1, 2, 3], SamplingParams(temperature=1.0, max_tokens=m))
            for rid, m in [("a", 4), ("b", 8), ("c", 8)]]
    seqs[1].grammar = _CutAfterOne()
    for seq in seqs:
        sched.add_seq(seq)
    sched.update_from_output(sched.schedule(), ModelRunnerOutput(sampled_token_ids=[5, 5, 5]))
    a, b, c = (seq.seq_id for seq in seqs)
    q = {a: torch.rand(4, 8), b: torch.rand(3, 8)}
    spec = SpecDecoder(_ProposerWithQ({a: [6, 7, 8, 9], b: [6, 7, 8], c: [6, 7]}, dict(q)), 4)
    spec.propose(sched.running)
    out = sched.schedule()
    spec.attach_draft_probs(out)
    assert out.spec_token_ids == {a: [6, 7], b: [6], c: [6, 7]}
    assert out.spec_draft_probs.keys() == {a} and torch.equal(out.spec_draft_probs[a], q[a][:2])
    stale = SchedulerOutput(seqs=[], num_scheduled_tokens=[], spec_token_ids={a: [6, 7]})
    spec.attach_draft_probs(stale)
    assert stale.spec_draft_probs == {}
