"""Scheduler: continuous batching, chunked prefill, preemption, abort, stop conditions, n > 1 sharing.

The model runner is simulated: every sequence whose sample flag is set "samples" a token we choose.
Block size 4 throughout, so block ids and token counts are easy to follow by hand.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.block_manager import BlockManager, assert_no_leak
from engine.outputs import ModelRunnerOutput, SchedulerOutput
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence, SequenceStatus

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
    flags: list[bool]              # sample flags, taken before the update moved num_computed_tokens
    tables: dict[str, list[int]]   # block tables as scheduled, before finished ones were freed
    updated: list[Sequence]

    @property
    def scheduled(self) -> list[tuple[str, int]]:
        return [(s.request_id, n) for s, n in zip(self.out.seqs, self.out.num_scheduled_tokens)]


def step(sched: Scheduler, token=TOK) -> Step:
    """schedule() + fake runner + update_from_output(); `token` is an int or a function of the sequence."""
    out = sched.schedule()
    flags = out.sample_flags()
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
    assert_no_leak(sched.block_manager)


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
    assert_no_leak(sched.block_manager)


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
    assert_no_leak(sched.block_manager)


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
    assert_no_leak(sched.block_manager)


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
    assert_no_leak(sched.block_manager)


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
    assert_no_leak(sched.block_manager)


@pytest.mark.parametrize("prompt, sp, match", [
    (60, {"max_tokens": 5}, r"prompt \(60 tokens\) \+ max_tokens \(5\) = 65 tokens exceeds max_model_len=64"),
    (64, {"max_tokens": None}, r"prompt \(64 tokens\) leaves no room for output within max_model_len=64"),
    (40, {"max_tokens": 20}, r"needs 15 KV blocks of 4 tokens, but the whole cache has num_blocks=8"),
    (30, {"max_tokens": None}, r"max_tokens \(34\) needs 16 KV blocks"),
    ([], {}, r"'r': the prompt is empty"),
])
def test_refuses_impossible_requests(prompt, sp, match):
    sched = make_sched(num_blocks=8)
    with pytest.raises(ValueError, match=match):
        sched.add_seq(make_seq("r", prompt, **sp))
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
    assert_no_leak(sched.block_manager)


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
    assert_no_leak(sched.block_manager)


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
    assert_no_leak(sched.block_manager)


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
    assert_no_leak(sched.block_manager)


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
    assert_no_leak(sched.block_manager)


# -- property test: random add / step / abort, invariants after every step ----------------------
VOCAB, P_EOS, P_STOP = 6, 5, 4  # tiny vocab: prompts share prefixes, samples hit EOS and stop ids often
P_LEN = 24                      # max_model_len of the property test

# Prompts are a common stem plus a random tail, so full-block prefix hits are frequent.
_STEM = [0, 1, 2, 3, 1, 0, 2, 1] * 3
_prompt = st.tuples(st.integers(0, 20), st.lists(st.integers(0, 3), max_size=6)).map(lambda t: _STEM[:t[0]] + t[1])
_add = st.tuples(st.just("add"), _prompt, st.integers(1, 8) | st.integers(1, 8) | st.none(),
                 st.integers(1, 3), st.integers(0, 3), st.booleans(), st.booleans())
_step = st.tuples(st.just("step"), st.integers(0, 2**31), st.booleans())
_abort = st.tuples(st.just("abort"), st.integers(0, 99))


class Harness:
    """Drives a Scheduler with a fake model that also keeps a fake KV cache: every slot holds the
    token prefix it was computed for, so reading a wrong (or stale, or foreign) block is caught."""

    def __init__(self, num_blocks, block_size, budget, max_num_seqs, caching):
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=caching)
        self.sched = Scheduler(max_num_seqs, budget, P_LEN, self.bm, [P_EOS])
        self.kv: dict[int, tuple[int, ...]] = {}
        self.seqs: list[Sequence] = []
        self.request_ids: list[str] = []

    def add(self, prompt, max_tokens, n, min_tokens, ignore_eos, stop):
        sp = SamplingParams(n=n, max_tokens=max_tokens, min_tokens=min(min_tokens, max_tokens or min_tokens),
                            ignore_eos=ignore_eos, stop_token_ids=[P_STOP] if stop else [])
        rid = f"r{len(self.request_ids)}"
        seqs = [Sequence(rid, prompt, sp, index=i) for i in range(n)]
        for s in seqs[1:]:
            s.prefix_source = seqs[0]
        num_out = P_LEN - len(prompt) if max_tokens is None else max_tokens
        fits = (prompt and num_out >= 1 and len(prompt) + num_out <= P_LEN
                and -(-(len(prompt) + num_out - 1) // self.bm.block_size) <= self.bm.num_blocks)
        try:
            for s in seqs:
                self.sched.add_seq(s)
        except ValueError:
            assert not fits and not self.sched.abort(rid)
            return
        assert fits
        self.seqs += seqs
        self.request_ids.append(rid)

    def step(self, seed, abort_mid=False):
        rng = random.Random(seed)
        had_work = self.sched.has_unfinished_seqs()
        out = self.sched.schedule()
        assert out.seqs or not had_work, "a step with unfinished requests scheduled nothing"
        self._check_schedule(out)
        for seq, n in zip(out.seqs, out.num_scheduled_tokens):
            self._run_model(seq, n)
        sampled = [rng.randrange(VOCAB) for f in out.sample_flags() if f]
        if abort_mid and self.sched.running:
            self.sched.abort(rng.choice(self.sched.running).request_id)
        self.sched.update_from_output(out, ModelRunnerOutput(sampled_token_ids=sampled))
        self._check_state()

    def _slot(self, seq, pos):
        return seq.block_table[pos // self.bm.block_size] * self.bm.block_size + pos % self.bm.block_size

    def _run_model(self, seq, n):
        start = seq.num_computed_tokens
        for pos in range(start):  # attention reads every earlier position
            assert self.kv.get(self._slot(seq, pos)) == tuple(seq.token_ids[:pos + 1]), (seq, pos)
        for pos in range(start, start + n):
            block_id = seq.block_table[pos // self.bm.block_size]
            assert self.bm.ref_counts[block_id] == 1 and self.bm.block_hashes[block_id] is None, \
                f"{seq} writes position {pos} into shared or cached block {block_id}"
            self.kv[self._slot(seq, pos)] = tuple(seq.token_ids[:pos + 1])

    def _check_schedule(self, out):
        sched = self.sched
        assert out.total_num_scheduled_tokens <= sched.max_num_batched_tokens
        assert len(out.seqs) == len(set(out.seqs)) <= sched.max_num_seqs
        assert not set(out.seqs) & set(out.preempted)
        for seq, n in zip(out.seqs, out.num_scheduled_tokens):
            assert seq.status is SequenceStatus.RUNNING and 1 <= n <= seq.num_tokens - seq.num_computed_tokens
            assert len(seq.block_table) * self.bm.block_size >= seq.num_computed_tokens + n

    def _check_state(self):
        sched, bs = self.sched, self.bm.block_size
        assert sched.num_running <= sched.max_num_seqs
        assert all(not s.block_table and s.num_computed_tokens == 0 for s in sched.waiting)
        self.bm.check_invariants(list(sched.running) + list(sched.waiting))
        holders: dict[int, list[tuple[Sequence, int]]] = {}
        for seq in sched.running:
            for i, block_id in enumerate(seq.block_table):
                holders.setdefault(block_id, []).append((seq, i))
        for block_id, held in holders.items():
            if len(held) > 1:  # shared only as a full, computed, identical prefix block
                (s0, i0) = held[0]
                for seq, i in held:
                    assert i == i0 and (i + 1) * bs <= seq.num_computed_tokens, (block_id, held)
                    assert seq.token_ids[:(i + 1) * bs] == s0.token_ids[:(i + 1) * bs], (block_id, held)

    def check_finished(self):
        for seq in self.seqs:
            sp, out = seq.sampling_params, seq.output_token_ids
            assert seq.is_finished and not seq.block_table, seq
            if seq.finish_reason == "stop":
                assert len(out) >= sp.min_tokens and (out[-1] == P_EOS and not sp.ignore_eos
                                                      or out[-1] in sp.stop_token_ids)
            elif seq.finish_reason == "length":
                assert len(out) == sp.max_tokens or seq.num_tokens == P_LEN
            else:
                assert seq.finish_reason == "abort"
        assert_no_leak(self.bm)


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(st.one_of(_add, _add, _step, _abort), max_size=40), num_blocks=st.integers(2, 24),
       block_size=st.sampled_from([1, 2, 4]), budget=st.integers(1, 12), max_num_seqs=st.integers(1, 5),
       caching=st.booleans())
def test_random_workload_invariants(ops, num_blocks, block_size, budget, max_num_seqs, caching):
    h = Harness(num_blocks, block_size, budget, max_num_seqs, caching)
    for op, *args in ops:
        if op == "add":
            h.add(*args)
        elif op == "step":
            h.step(*args)
        elif h.request_ids:
            h.sched.abort(h.request_ids[args[0] % len(h.request_ids)])
            h._check_state()
    for i in range(3000):  # every request finishes: bounded, not "eventually"
        if not h.sched.has_unfinished_seqs():
            break
        h.step(i)
    h.check_finished()
