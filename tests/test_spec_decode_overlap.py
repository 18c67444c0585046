"""Speculative decoding with overlapped scheduling (`async_scheduling=True`): the same outputs as
one step at a time, and steps overlap while every sequence's drafts are paused.

A step's drafts are proposed from its sequences' tokens on the host, so a step that may carry
drafts waits for the previous one (LLMEngine.step, SpecDecoder.needs_previous_tokens); a step
in which every decoding sequence is paused by the acceptance guard (drafts rejected, or with
overlap, proposals that found nothing) is launched before the previous one is processed. On CPU
the launches run synchronously, but the bookkeeping is the GPU's (placeholders, decode inputs
from the previous step's device tensor, rolled-back drafts)."""
import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.block_manager import BlockManager
from engine.core.messages import ModelRunnerOutput, SchedulerOutput
from engine.core.scheduler import Scheduler
from engine.core.sequence import Sequence
from engine.spec_decode.acceptance_guard import MIN_COOLDOWN_STEPS
from engine.spec_decode.spec_decoder import SpecDecoder
from tests.test_spec_decode import LETTERS, NGRAM, _accepted, _feature_requests, _generate, _prompts, _same

REGIMES = {
    "roomy": {},
    "chunked_prefill": {"max_num_batched_tokens": 48},
    "preemption": {"num_kv_blocks": 14, "max_num_batched_tokens": 256},
}


def _launch_log(llm) -> list[tuple[bool, bool, bool]]:
    """Per launched step: (a step was in flight, that step had drafts, this step has drafts)."""
    engine, log = llm.llm_engine, []
    forward = engine.executor.forward

    def logged(sched_out):
        inflight = engine._inflight
        log.append((inflight is not None, bool(inflight and inflight.scheduler_output.spec_token_ids),
                    bool(sched_out.spec_token_ids)))
        return forward(sched_out)
    engine.executor.forward = logged
    return log


def _assert_never_overlaps_drafts(log) -> None:
    """Drafts are never launched over a step in flight, nor is any step launched over one with drafts."""
    assert not any(inflight and (inflight_drafts or drafts) for inflight, inflight_drafts, drafts in log)


@pytest.fixture(scope="module")
def plain(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", device="cpu")
    yield llm
    llm.shutdown()


@pytest.mark.parametrize("regime", REGIMES)
def test_greedy_and_sampling_features_equal_decoding_one_token_at_a_time(tiny_llama, plain, regime):
    """Greedy requests with every feature that reads the output so far (penalties, min_tokens,
    stop tokens, bad words, n > 1, logprobs), overlapped and speculating, against the plain engine."""
    _check_against_plain(LLM(tiny_llama, dtype="float32", device="cpu", speculative_config=NGRAM,
                             async_scheduling=True, **REGIMES[regime]), plain, regime)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_overlapped_speculation_on_cuda_equals_the_plain_engine(tiny_llama):
    """On CUDA the launches really overlap, decode-only steps replay CUDA graphs and verification
    steps run eagerly; the plain engine is CUDA's too (k + 1 rows round differently from one)."""
    with LLM(tiny_llama, dtype="float32", device="cuda") as plain:
        _check_against_plain(LLM(tiny_llama, dtype="float32", device="cuda", speculative_config=NGRAM),
                             plain, "roomy")


def _check_against_plain(llm, plain, regime: str) -> None:
    assert llm.llm_engine.async_scheduling
    log = _launch_log(llm)
    vocab = llm.llm_engine.model_config.vocab_size
    prompts, params = _feature_requests([[LETTERS[i % 3]] * (9 + i) for i in range(4)])
    prompts += _prompts(vocab)
    params += [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)] * 4
    _same(_generate(llm, prompts, params), _generate(plain, prompts, params))
    assert _accepted(llm) > 0
    assert llm.llm_engine.num_spec_waits > 0
    _assert_never_overlaps_drafts(log)
    if regime == "preemption":
        assert llm.llm_engine.scheduler.num_preemptions > 0, "the tiny cache should have forced preemption"
    llm.shutdown()


def test_steps_overlap_while_every_sequence_is_paused(tiny_llama, plain):
    """Text that does not copy (random prompts sampled at temperature 1): the n-gram proposer mostly
    finds nothing, the guard pauses those sequences, and their steps overlap; greedy requests in the
    same batch still equal the plain engine's."""
    llm = LLM(tiny_llama, dtype="float32", device="cpu", speculative_config=NGRAM, async_scheduling=True)
    log = _launch_log(llm)
    vocab = llm.llm_engine.model_config.vocab_size
    prompts = [[(31 * i + 7 * j * j) % vocab for j in range(20 + i)] for i in range(8)]
    sampled = [SamplingParams(temperature=1.0, seed=i, max_tokens=64, ignore_eos=True) for i in range(6)]
    greedy = [SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)] * 2
    outs = _generate(llm, prompts, sampled + greedy)
    assert [len(o.outputs[0].token_ids) for o in outs] == [64] * 8
    want = _generate(plain, prompts[6:], greedy)
    assert [o.outputs[0].token_ids for o in outs[6:]] == [o.outputs[0].token_ids for o in want]
    _assert_never_overlaps_drafts(log)
    overlapped = sum(inflight for inflight, _, _ in log)
    assert overlapped >= len(log) // 4, (overlapped, len(log))  # the plain engine overlaps all but the first
    first_overlap = [inflight for inflight, _, _ in log].index(True)
    assert not all(inflight for inflight, _, _ in log[first_overlap:]), "the guard should probe again after a pause"
    llm.shutdown()


class _NothingFound:
    """A proposer whose lookups never match."""

    def propose(self, seqs):
        return [[] for _ in seqs]

    def take_draft_probs(self):
        return {}

    def retain(self, seq_ids):
        pass


def _decoding_seq(sched: Scheduler) -> Sequence:
    seq = Sequence("a", [1, 2, 3], SamplingParams(max_tokens=200, ignore_eos=True))
    sched.add_seq(seq)
    sched.update_from_output(sched.schedule(), ModelRunnerOutput(sampled_token_ids=[5]))
    return seq


@pytest.mark.parametrize("overlap", [False, True])
def test_a_proposal_that_finds_nothing_pauses_the_sequence_only_with_overlap(overlap):
    """One step at a time, asking costs no wait: the sequence is asked at every step. Overlapped,
    asking costs one, so proposals that keep finding nothing pause it as rejected drafts do."""
    sched = Scheduler(8, 64, 256, BlockManager(64, 4), eos_token_ids=[0])
    seq = _decoding_seq(sched)
    spec = SpecDecoder(_NothingFound(), 4, pause_without_drafts=overlap)
    asked = []
    for _ in range(40):
        spec.propose(sched.running)
        asked.append(not spec.guard.is_paused(seq.seq_id))
        out = sched.schedule()
        sched.update_from_output(out, ModelRunnerOutput(sampled_token_ids=[5]))
    assert all(asked) is not overlap
    if overlap:  # 3 misses bring the average under 0.5 (as 3 rejected drafts do), then a cool-down
        assert asked[:3] == [True, True, False] and not any(asked[3:3 + MIN_COOLDOWN_STEPS - 1])


def test_the_next_step_waits_only_for_drafts_in_flight_or_a_sequence_that_may_get_them():
    sched = Scheduler(8, 64, 256, BlockManager(64, 4), eos_token_ids=[0])
    seq = _decoding_seq(sched)
    spec = SpecDecoder(_NothingFound(), 4, pause_without_drafts=True)
    plain = sched.schedule()  # seq's token is in flight: a placeholder
    assert seq.num_output_placeholders == 1
    assert spec.needs_previous_tokens(sched.running, plain)  # its drafts would follow that token
    for _ in range(3):
        spec.guard.observe(seq.seq_id, 4, 0)
    assert spec.guard.is_paused(seq.seq_id)
    assert not spec.needs_previous_tokens(sched.running, plain)  # paused: overlap
    with_drafts = SchedulerOutput(seqs=[], num_scheduled_tokens=[], spec_token_ids={seq.seq_id: [6]})
    assert spec.needs_previous_tokens(sched.running, with_drafts)  # the accepted count moves seq
    sched.update_from_output(plain, ModelRunnerOutput(sampled_token_ids=[5]))
    spec.guard.retain(set())
    assert not spec.needs_previous_tokens(sched.running, plain)  # no token in flight: nothing to wait for
