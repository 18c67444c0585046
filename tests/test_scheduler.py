"""Scheduler: continuous batching, chunked prefill, preemption, abort, stop conditions, n > 1 sharing.

The model runner is simulated: every sequence whose sample flag is set "samples" a token we choose.
Block size 4 throughout, so block ids and token counts are easy to follow by hand.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from engine.core.block_manager import BlockManager
from engine.errors import InvalidRequestError, PromptTooLongError
from engine.core.messages import ModelRunnerOutput, SchedulerOutput
from engine.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler
from engine.core.sequence import Sequence, SequenceStatus

BS = 4
EOS = 2
TOK = 7  # what the fake model samples unless told otherwise


def make_sched(num_blocks=32, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64,
               enable_prefix_caching=True, eos_token_ids=(EOS,)) -> Scheduler:
    bm = BlockManager(num_blocks, BS, enable_prefix_caching=enable_prefix_caching)
    return Scheduler(max_num_seqs, max_num_batched_tokens, max_model_len, bm, list(eos_token_ids))


def make_seq(rid: str, prompt, **sp) -> Sequence:
    """`prompt` is a token list, or a length: then tokens unique to `rid`, so no accidental prefix hits."""
    base = 1000 * (1 + sum(map(ord, rid)))
    tokens = list(range(base, base + prompt)) if isinstance(prompt, int) else list(prompt)
    return Sequence(rid, tokens, SamplingParams(**{"max_tokens": 4, **sp}))


@dataclass
class Step:
    out: SchedulerOutput
    flags: list[bool]              # sample flags, as scheduled
    tables: dict[str, list[int]]   # block tables as scheduled, before finished ones were freed
    updated: list[Sequence]

    @property
    def scheduled(self) -> list[tuple[str, int]]:
        return [(s.request_id, n) for s, n in zip(self.out.seqs, self.out.num_scheduled_tokens)]


def step(sched: Scheduler, token=TOK) -> Step:
    """schedule() + fake runner + update_from_output(); `token` is an int or a function of the sequence."""
    out = sched.schedule()
    flags = out.sample_flags
    tables = {f"{s.request_id}{s.index or ''}": list(s.block_table) for s in out.seqs}
    sampled = [token(s) if callable(token) else token for s, f in zip(out.seqs, flags) if f]
    updated = sched.update_from_output(out, ModelRunnerOutput(sampled_token_ids=sampled))
    return Step(out, flags, tables, updated)


def run_all(sched: Scheduler, token=TOK, max_steps=200) -> int:
    for n in range(max_steps):
        if not sched.has_unfinished_seqs():
            return n
        step(sched, token)
    raise AssertionError(f"not finished after {max_steps} steps: {sched.running} {sched.waiting}")


def test_mixed_prefill_and_decode_in_one_step():
    sched = make_sched()
    a = make_seq("a", 6)
    sched.add_seq(a)
    st = step(sched)
    assert st.scheduled == [("a", 6)] and st.updated == [a] and a.output_token_ids == [TOK]
    sched.add_seq(make_seq("b", 5))
    st = step(sched)
    assert st.scheduled == [("a", 1), ("b", 5)] and st.flags == [True, True]
    assert st.tables == {"a": [0, 1], "b": [2, 3]}
    run_all(sched)
    sched.block_manager.check_no_leak()


def test_chunked_prefill_under_tiny_budget():
    sched = make_sched(max_num_batched_tokens=4)
    a = make_seq("a", 3, max_tokens=3)
    b = make_seq("b", 10)
    sched.add_seq(a)
    sched.add_seq(b)
    chunks = []
    for _ in range(4):
        st = step(sched)
        chunks.append((st.scheduled, st.flags))
        assert st.out.total_num_scheduled_tokens <= 4
    assert chunks == [
        ([("a", 3), ("b", 1)], [True, False]),   # a's whole prompt, b's first token
        ([("a", 1), ("b", 3)], [True, False]),   # a decodes, b continues its prompt
        ([("a", 1), ("b", 3)], [True, False]),   # a samples its 3rd token and finishes
        ([("b", 3)], [True]),                    # b's last chunk reaches the end: it samples
    ]
    assert a.finish_reason == "length" and b.num_computed_tokens == 10 and b.output_token_ids == [TOK]
    run_all(sched)
    sched.block_manager.check_no_leak()


def test_max_num_seqs_cap():
    sched = make_sched(max_num_seqs=2)
    seqs = [make_seq(r, 3, max_tokens=2) for r in "abc"]
    for s in seqs:
        sched.add_seq(s)
    st = step(sched)
    assert st.scheduled == [("a", 3), ("b", 3)] and sched.num_waiting == 1
    st = step(sched)  # a and b finish here, freeing their slots only after the step
    assert st.scheduled == [("a", 1), ("b", 1)]
    st = step(sched)
    assert st.scheduled == [("c", 3)]
    run_all(sched)
    sched.block_manager.check_no_leak()


def test_preempt_newest_then_it_finishes():
    # 4 blocks; a and b hold 2 each. a's 3rd decode needs a 3rd block: b (newest) is preempted.
    sched = make_sched(num_blocks=4)
    a = make_seq("a", range(10, 17), max_tokens=3)
    b = make_seq("b", range(20, 27), max_tokens=3)
    c = make_seq("c", range(30, 33), max_tokens=1)
    for s in (a, b):
        sched.add_seq(s)
    step(sched)
    step(sched)
    assert a.block_table == [0, 1] and b.block_table == [2, 3]
    sched.add_seq(c)
    st = step(sched)
    assert st.scheduled == [("a", 1)] and st.out.preempted == [b]
    assert st.tables["a"] == [0, 1, 3]  # b's tail block (evicted) freed first
    assert list(sched.waiting) == [b, c] and b.status is SequenceStatus.WAITING  # front, ahead of c
    assert b.num_preemptions == 1 and sched.num_preemptions == 1 and b.num_computed_tokens == 0
    assert a.finish_reason == "length"
    st = step(sched)
    # b recomputes prompt + 2 outputs (9 tokens); its first block survived in the prefix cache.
    assert st.scheduled == [("b", 5), ("c", 3)] and b.num_computed_tokens == 9
    assert b.output_token_ids == [TOK] * 3 and b.finish_reason == "length"
    assert b.num_cached_tokens == 0  # metric keeps the first admission's value
    run_all(sched)
    sched.block_manager.check_no_leak()


def test_newest_preempts_itself():
    sched = make_sched(num_blocks=4)
    a = make_seq("a", 6, max_tokens=2)
    b = make_seq("b", range(50, 58), max_tokens=2)  # 9th token needs a 3rd block
    sched.add_seq(a)
    sched.add_seq(b)
    step(sched)
    st = step(sched)
    assert st.scheduled == [("a", 1)] and st.out.preempted == [b] and list(sched.waiting) == [b]
    run_all(sched)
    assert b.finish_reason == "length" and len(b.output_token_ids) == 2
    sched.block_manager.check_no_leak()


def test_abort_waiting_running_and_mid_step():
    sched = make_sched(max_num_seqs=1)
    a, b = make_seq("a", 6), make_seq("b", 5)
    sched.add_seq(a)
    sched.add_seq(b)
    step(sched)
    assert sched.abort("b") == [b] and b.finish_reason == "abort" and sched.num_waiting == 0
    assert sched.abort("nope") == []
    assert sched.block_manager.get_num_free_blocks() == 30
    out = sched.schedule()
    assert sched.abort("a") == [a] and a.is_finished
    assert sched.update_from_output(out, ModelRunnerOutput(sampled_token_ids=[TOK])) == []  # skipped
    assert a.output_token_ids == [TOK] and not sched.has_unfinished_seqs()
    sched.block_manager.check_no_leak()


@pytest.mark.parametrize("prompt, sp, match", [
    (60, {"max_tokens": 5}, r"prompt \(60 tokens\) \+ max_tokens \(5\) = 65 tokens exceeds max_model_len=64"),
    (64, {"max_tokens": None}, r"prompt \(64 tokens\) leaves no room for output within max_model_len=64"),
    (40, {"max_tokens": 20}, r"needs 15 KV blocks of 4 tokens, but the whole cache has num_blocks=8"),
    (30, {"max_tokens": None}, r"max_tokens \(34\) needs 16 KV blocks"),
    ([], {}, r"'r': the prompt is empty"),
])
def test_refuses_impossible_requests(prompt, sp, match):
    sched = make_sched(num_blocks=8)
    with pytest.raises(ValueError, match=match) as info:
        sched.add_seq(make_seq("r", prompt, **sp))
    assert type(info.value) is (InvalidRequestError if prompt == [] else PromptTooLongError)
    assert info.value.param == "prompt"  # the request's name prefixed, the type and param kept
    assert not sched.has_unfinished_seqs()


def test_request_that_exactly_fits_the_cache_runs():
    sched = make_sched(num_blocks=2)
    s = make_seq("r", 5, max_tokens=4)  # 8 KV tokens: the 9th (last sampled) is never fed back
    sched.add_seq(s)
    run_all(sched)
    assert s.finish_reason == "length" and s.num_tokens == 9


@pytest.mark.parametrize("sp, tokens, reason, stop_reason, num_out", [
    ({}, [5, EOS, 5], "stop", None, 2),
    ({"ignore_eos": True}, [EOS] * 4, "length", None, 4),
    ({"stop_token_ids": [9]}, [5, 9], "stop", 9, 2),
    ({"max_tokens": 3}, [5] * 3, "length", None, 3),
    ({"min_tokens": 3}, [EOS, 9, EOS, 5], "stop", None, 3),
    ({"min_tokens": 2, "stop_token_ids": [9]}, [9, 9], "stop", 9, 2),
    ({"max_tokens": None}, [5] * 60, "length", None, 60),  # up to max_model_len=64
])
def test_stop_conditions(sp, tokens, reason, stop_reason, num_out):
    sched = make_sched()
    s = make_seq("r", 4, **sp)
    sched.add_seq(s)
    run_all(sched, token=lambda seq: tokens[seq.num_output_tokens])
    assert (s.finish_reason, s.stop_reason, s.num_output_tokens) == (reason, stop_reason, num_out)
    assert s.output_token_ids == tokens[:num_out]  # the stop token itself is kept, as vLLM does
    sched.block_manager.check_no_leak()


def test_several_eos_ids():
    sched = make_sched(eos_token_ids=(2, 3))
    s = make_seq("r", 4)
    sched.add_seq(s)
    step(sched, token=3)
    assert s.finish_reason == "stop" and s.output_token_ids == [3]


def test_finish_seq_by_engine():
    sched = make_sched()
    s = make_seq("r", 4)
    sched.add_seq(s)
    step(sched)
    sched.finish_seq(s, "stop", stop_reason="###")
    sched.finish_seq(s, "abort")  # already finished: no-op
    assert (s.finish_reason, s.stop_reason) == ("stop", "###") and not sched.has_unfinished_seqs()
    with pytest.raises(ValueError, match="'done'"):
        sched.finish_seq(s, "done")
    sched.block_manager.check_no_leak()


def _siblings(n, prompt, **sp):
    seqs = [Sequence("r", list(range(100, 100 + prompt)), SamplingParams(n=n, max_tokens=3, **sp), index=i)
            for i in range(n)]
    for s in seqs[1:]:
        s.prefix_source = seqs[0]
    return seqs


def test_n_siblings_share_prompt_blocks():
    sched = make_sched(max_num_batched_tokens=12, enable_prefix_caching=False)
    src, s1, s2 = _siblings(3, 10)
    for s in (src, s1, s2):
        sched.add_seq(s)
    c = make_seq("c", 5)
    sched.add_seq(c)
    st = step(sched)
    # The siblings wait for src's prompt but keep their place; c behind them still gets the budget left.
    assert st.scheduled == [("r", 10), ("c", 2)] and list(sched.waiting) == [s1, s2]
    st = step(sched)
    assert st.scheduled == [("r", 1), ("c", 3), ("r", 2), ("r", 2)]  # siblings compute only the tail
    assert s1.block_table[:2] == s2.block_table[:2] == src.block_table[:2] == [0, 1]
    assert sched.block_manager.ref_counts[:2] == [3, 3] and s1.num_cached_tokens == 8
    assert len({s1.block_table[2], s2.block_table[2], src.block_table[2]}) == 3
    run_all(sched)
    assert all(s.finish_reason == "length" for s in (src, s1, s2))
    sched.block_manager.check_no_leak()


def test_sibling_goes_alone_when_source_is_gone():
    sched = make_sched(max_num_batched_tokens=4, enable_prefix_caching=False)
    src, s1 = _siblings(2, 10)
    sched.add_seq(src)
    sched.add_seq(s1)
    step(sched)
    sched.finish_seq(src, "abort")  # e.g. a stop string right away
    st = step(sched)
    assert st.scheduled == [("r", 4)] and st.out.seqs == [s1]
    run_all(sched)
    assert s1.finish_reason == "length"
    sched.block_manager.check_no_leak()


def test_prefix_cache_hit_across_requests():
    sched = make_sched()
    a = make_seq("a", range(10), max_tokens=1)
    sched.add_seq(a)
    run_all(sched)
    b = make_seq("b", range(10))
    sched.add_seq(b)
    st = step(sched)
    assert st.scheduled == [("b", 2)] and b.num_cached_tokens == 8 and b.block_table[:2] == [0, 1]
    run_all(sched)
    sched.block_manager.check_no_leak()


def test_prompt_logprobs_request_takes_capped_chunks(monkeypatch):
    # Each of its rows is scored over the whole vocab: the cap bounds that step's logits memory.
    # The budget it leaves goes to the other request.
    import engine.core.scheduler
    monkeypatch.setattr(engine.core.scheduler, "MAX_PROMPT_LOGPROB_ROWS", 8)
    sched = make_sched(max_num_batched_tokens=32)
    sched.add_seq(make_seq("scored", 20, prompt_logprobs=1))
    sched.add_seq(make_seq("plain", 20))
    first = step(sched)
    assert first.out.num_scheduled_tokens == [8, 20]
    assert step(sched).out.num_scheduled_tokens[0] == 8
    run_all(sched)
    sched.block_manager.check_no_leak()


def test_max_loras_limits_the_adapters_running_at_once():
    """max_loras=1: a waiting sequence of another adapter keeps its place while later ones of
    the running adapter (or the base model) go; it runs once the running adapter's are done."""
    from engine.lora import LoRARequest

    bm = BlockManager(32, BS)
    sched = Scheduler(8, 64, 64, bm, [EOS], max_loras=1)
    l1, l2 = LoRARequest("one", 1, "/unused"), LoRARequest("two", 2, "/unused")
    seqs = [Sequence(rid, list(range(100 * i, 100 * i + 5)), SamplingParams(max_tokens=2), lora_request=lr)
            for i, (rid, lr) in enumerate([("a", l1), ("b", l2), ("c", l1), ("d", None)], start=1)]
    for s in seqs:
        sched.add_seq(s)
    first = step(sched)
    assert [rid for rid, _ in first.scheduled] == ["a", "c", "d"]
    assert [s.request_id for s in sched.waiting] == ["b"]
    assert [rid for rid, _ in step(sched).scheduled] == ["a", "c", "d"]  # they finish (max_tokens=2)
    assert [rid for rid, _ in step(sched).scheduled] == ["b"]
    run_all(sched)
    bm.check_no_leak()


def verify(sched: Scheduler, sampled: list[int], num_accepted: list[int]) -> SchedulerOutput:
    """schedule() + a fake verification: each sequence keeps its first num_accepted drafts."""
    out = sched.schedule()
    sched.update_from_output(out, ModelRunnerOutput(sampled_token_ids=sampled, num_accepted_tokens=num_accepted))
    return out


def test_drafts_get_lookahead_slots_and_rejected_ones_are_rolled_back():
    sched = make_sched()
    seq = make_seq("a", 6, max_tokens=6)
    sched.add_seq(seq)
    step(sched)  # the prompt: blocks [0, 1], TOK sampled
    seq.spec_token_ids = [11, 12, 13, 14]
    out = verify(sched, [9], [1])
    assert out.num_scheduled_tokens == [5] and out.spec_token_ids == {seq.seq_id: [11, 12, 13, 14]}
    assert seq.output_token_ids == [TOK, 11, 9] and seq.num_computed_tokens == 8
    assert seq.block_table == [0, 1] and sched.block_manager.ref_counts[2] == 0  # block 2: rejected slots only
    seq.spec_token_ids = [5, 6, 7]
    out = verify(sched, [8], [2])  # 3 of max_tokens=6 made: two drafts and the bonus token fit
    assert out.spec_token_ids == {seq.seq_id: [5, 6]} and out.num_scheduled_tokens == [3]
    assert seq.output_token_ids == [TOK, 11, 9, 5, 6, 8] and seq.finish_reason == "length"
    sched.block_manager.check_no_leak()


def test_eos_inside_accepted_drafts_ends_the_output_there():
    sched = make_sched(max_num_batched_tokens=3)
    seq = make_seq("a", 2, max_tokens=10)
    sched.add_seq(seq)
    step(sched)
    seq.spec_token_ids = [3, EOS, 4, 5]
    out = verify(sched, [6], [2])
    assert out.spec_token_ids == {seq.seq_id: [3, EOS]}  # the token budget: 1 + 2 drafts
    assert seq.output_token_ids == [TOK, 3, EOS] and seq.finish_reason == "stop"
    sched.block_manager.check_no_leak()
