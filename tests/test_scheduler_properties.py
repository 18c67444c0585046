"""Scheduler property test: random add / step / abort sequences (n > 1 siblings sharing a prompt,
prefix-cache hits, preemption when a small cache runs out, either scheduling policy with random
priorities, a host KV tier behind the prefix cache), invariants after every step (blocks
conserved and never owned twice, ref counts never negative, KV contents, swapped-in blocks
included, the prefix-cache counters equal to the tokens really reused, finish reasons), and
everything free at the end.

With `overlap`, the harness drives the scheduler as the engine's overlapped scheduling does:
step N+1 is scheduled (and its fake forward run) before step N's tokens are given back.

With `spec`, the harness plays speculative decoding: before each step every decoding sequence
gets 0-3 random draft tokens, the fake forward writes their KV, and a random prefix of them is
accepted (EOS and stop ids among them), so rejected slots are rolled back: the fake KV check then
proves no later step reads a rejected draft's KV, and the block checks that rejected slots' blocks
go back and no block holding a rejected token is ever registered in the prefix cache."""
from __future__ import annotations

import random

from hypothesis import event, given, settings, target
from hypothesis import strategies as st

from engine.core.block_manager import BlockManager
from engine.core.kv_offload import OffloadingBlockManager
from engine.core.messages import ModelRunnerOutput
from engine.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler
from engine.core.sequence import Sequence, SequenceStatus

VOCAB, P_EOS, P_STOP = 6, 5, 4  # tiny vocab: prompts share prefixes, samples hit EOS and stop ids often
P_LEN = 24                      # max_model_len of the property test

# Prompts are a common stem plus a random tail, so full-block prefix hits are frequent.
_STEM = [0, 1, 2, 3, 1, 0, 2, 1] * 3
_prompt = st.tuples(st.integers(0, 20), st.lists(st.integers(0, 3), max_size=6)).map(lambda t: _STEM[:t[0]] + t[1])
_add = st.tuples(st.just("add"), _prompt, st.integers(1, 8) | st.integers(1, 8) | st.none(),
                 st.integers(1, 3), st.integers(0, 3), st.booleans(), st.booleans(), st.integers(0, 2))
_step = st.tuples(st.just("step"), st.integers(0, 2**31), st.booleans())
_drain = st.tuples(st.just("drain"))  # an idle engine processes its last launched step
_abort = st.tuples(st.just("abort"), st.integers(0, 99))


class Harness:
    """Drives a Scheduler with a fake model that also keeps a fake KV cache: every slot holds the
    token prefix it was computed for, so reading a wrong (or stale, or foreign) block is caught.
    With host blocks, the step's swaps copy those fake slots to and from a fake host tier first."""

    def __init__(self, num_blocks, block_size, budget, max_num_seqs, caching, overlap=False, policy="fcfs",
                 host_blocks=0, spec=False):
        if host_blocks:
            self.bm = OffloadingBlockManager(num_blocks, block_size, host_blocks)
            caching = True
        else:
            self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=caching)
        self.host_kv: dict[int, tuple[int, ...] | None] = {}
        self.sched = Scheduler(max_num_seqs, budget, P_LEN, self.bm, [P_EOS], policy=policy)
        self.policy = policy
        self.kv: dict[int, tuple[int, ...]] = {}
        self.seqs: list[Sequence] = []
        self.request_ids: list[str] = []
        self.caching = caching
        self.num_queried_tokens = 0  # what the block manager's hit-rate counters must say
        self.num_hit_tokens = 0
        self.overlap = overlap
        self.spec = spec  # speculative decoding runs without overlap, as in the engine
        self.num_verified = 0  # steps that verified drafts
        self.pending = None  # (SchedulerOutput, sampled ids) of the launched, unprocessed step

    def add(self, prompt, max_tokens, n, min_tokens, ignore_eos, stop, priority):
        sp = SamplingParams(n=n, max_tokens=max_tokens, min_tokens=min(min_tokens, max_tokens or min_tokens),
                            ignore_eos=ignore_eos, stop_token_ids=[P_STOP] if stop else [])
        rid = f"r{len(self.request_ids)}"
        priority = priority if self.policy == "priority" else 0
        seqs = [Sequence(rid, prompt, sp, index=i, priority=priority) for i in range(n)]
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
        had_work = self.sched.has_unfinished_seqs() and not self.pending
        waiting = set(self.sched.waiting)
        if self.spec:
            for seq in self.sched.running:
                if seq.num_computed_tokens + 1 == seq.num_tokens:
                    seq.spec_token_ids = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 4))]
        out = self.sched.schedule()
        # Overlapped, a step may be empty: every running sequence waits on its in-flight token.
        assert out.seqs or not had_work, "a step with unfinished requests scheduled nothing"
        self._check_schedule(out)
        self._count_reuse([(s, start) for s, start in zip(out.seqs, out.num_computed_tokens) if s in waiting])
        if out.preempted:
            event("preempted")
        self._swap(out)
        for seq, start, n in zip(out.seqs, out.num_computed_tokens, out.num_scheduled_tokens):
            self._run_model(seq, start, n, out.spec_token_ids.get(seq.seq_id, []))
        sampled = [rng.randrange(VOCAB) for f in out.sample_flags if f]
        accepted = [rng.randrange(len(out.spec_token_ids.get(s.seq_id, [])) + 1) for s in out.sampled_seqs]
        if out.spec_token_ids:
            event("draft tokens verified")
            self.num_verified += 1
        if abort_mid and self.sched.running:
            self.sched.abort(rng.choice(self.sched.running).request_id)
        if self.overlap:
            self.drain()  # the previous step, processed while this one "runs"
            self.pending = (out, sampled) if out.seqs else None
        else:
            self.sched.update_from_output(out, ModelRunnerOutput(
                sampled_token_ids=sampled, num_accepted_tokens=accepted if out.spec_token_ids else None))
            self._check_rolled_back(out)
        self._check_state()

    def _check_rolled_back(self, out):
        """After verification a running sequence holds exactly the blocks of its computed tokens."""
        for seq in out.seqs:
            if out.spec_token_ids and seq.seq_id in out.spec_token_ids and seq.status is SequenceStatus.RUNNING:
                assert seq.num_computed_tokens == seq.num_tokens - 1, seq
                assert len(seq.block_table) == -(-seq.num_computed_tokens // self.bm.block_size), seq

    def _swap(self, out):
        """The host tier's copies, as the worker runs them before the forward: outs, then ins."""
        bs = self.bm.block_size
        for device_block, host_block in out.blocks_to_swap_out:
            for off in range(bs):
                self.host_kv[host_block * bs + off] = self.kv.get(device_block * bs + off)
        for host_block, device_block in out.blocks_to_swap_in:
            event("swapped in from the host tier")
            for off in range(bs):
                self.kv[device_block * bs + off] = self.host_kv.get(host_block * bs + off)

    def drain(self):
        if self.pending is not None:
            out, sampled = self.pending
            self.pending = None
            self.sched.update_from_output(out, ModelRunnerOutput(sampled_token_ids=sampled))
            self._check_state()

    def _true_tokens(self, seq):
        """seq's tokens including the one its in-flight step sampled (still a placeholder to it)."""
        if self.pending is None or not seq.num_output_placeholders:
            return seq.token_ids
        out, sampled = self.pending
        rows = [s for s, f in zip(out.seqs, out.sample_flags) if f]
        return seq.token_ids + [sampled[rows.index(seq)]] if seq in rows else seq.token_ids

    def _count_reuse(self, admitted):
        """Admitted this step: the tokens before their first chunk are the cached or shared ones they
        reuse (the fake KV check in _run_model proves those are right); each admission counts once."""
        for seq, start in admitted:
            if start:
                event("prefix reused (shared by a sibling or from the cache)")
            if self.caching:
                self.num_queried_tokens += seq.num_tokens
                self.num_hit_tokens += start
        assert (self.bm.num_queried_tokens, self.bm.num_hit_tokens) == (self.num_queried_tokens,
                                                                        self.num_hit_tokens)

    def _slot(self, seq, pos):
        return seq.block_table[pos // self.bm.block_size] * self.bm.block_size + pos % self.bm.block_size

    def _run_model(self, seq, start, n, drafts):
        tokens = self._true_tokens(seq) + drafts
        assert start + n <= len(tokens), (seq, start, n)
        for pos in range(start):  # attention reads every earlier position
            assert self.kv.get(self._slot(seq, pos)) == tuple(tokens[:pos + 1]), (seq, pos)
        for pos in range(start, start + n):
            block_id = seq.block_table[pos // self.bm.block_size]
            assert self.bm.ref_counts[block_id] == 1 and self.bm.block_hashes[block_id] is None, \
                f"{seq} writes position {pos} into shared or cached block {block_id}"
            self.kv[self._slot(seq, pos)] = tuple(tokens[:pos + 1])

    def _check_schedule(self, out):
        sched = self.sched
        assert out.total_num_scheduled_tokens <= sched.max_num_batched_tokens
        assert len(out.seqs) == len(set(out.seqs)) <= sched.max_num_seqs
        assert not set(out.seqs) & set(out.preempted)
        for seq, start, n in zip(out.seqs, out.num_computed_tokens, out.num_scheduled_tokens):
            num_spec = len(out.spec_token_ids.get(seq.seq_id, []))
            assert seq.status is SequenceStatus.RUNNING and seq.num_computed_tokens == start + n
            assert 1 <= n <= seq.num_tokens_with_placeholders + num_spec - start
            assert not num_spec or n == num_spec + 1, "drafts only on a decode"
            assert seq.num_output_placeholders <= (2 if self.overlap else 1)
            # The last output token is never fed back: nothing computes past it (nor past max_model_len).
            max_tokens = seq.sampling_params.max_tokens
            assert start + n <= min(P_LEN, seq.num_prompt_tokens + (max_tokens or P_LEN)) - 1, (seq, start, n)
            assert len(seq.block_table) * self.bm.block_size >= start + n

    def _check_state(self):
        sched, bs = self.sched, self.bm.block_size
        assert sched.num_running <= sched.max_num_seqs
        assert all(not s.block_table and s.num_computed_tokens == 0 for s in sched.waiting)
        assert min(self.bm.ref_counts) >= 0
        owned = {b for s in sched.running for b in s.block_table}
        assert len(owned) + self.bm.get_num_free_blocks() == self.bm.num_blocks, "blocks not conserved"
        assert all(len(set(s.block_table)) == len(s.block_table) for s in sched.running)
        if self.policy == "priority":  # the last running sequence is the one preempted first
            keys = [(s.priority, s.arrival_time, s.seq_id) for s in sched.running]
            assert keys == sorted(keys), keys
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
        self.bm.check_no_leak()


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(st.one_of(_add, _add, _step, _step, _abort, _drain), max_size=40),
       num_blocks=st.integers(5, 10) | st.integers(2, 24),  # small caches preempt often
       block_size=st.sampled_from([1, 2, 4]), budget=st.integers(1, 12), max_num_seqs=st.integers(1, 5),
       caching=st.booleans(), overlap=st.booleans(), policy=st.sampled_from(["fcfs", "priority"]),
       host_blocks=st.sampled_from([0, 0, 1, 3, 12]))
def test_random_workload_invariants(ops, num_blocks, block_size, budget, max_num_seqs, caching, overlap, policy,
                                    host_blocks):
    h = Harness(num_blocks, block_size, budget, max_num_seqs, caching, overlap, policy, host_blocks)
    _run(h, ops)
    if overlap:
        event("overlapped scheduling")
    target(float(h.sched.num_preemptions), label="preemptions")  # steer generation toward preempting


@settings(max_examples=100, deadline=None)
@given(ops=st.lists(st.one_of(_add, _add, _step, _step, _abort), max_size=30),
       num_blocks=st.integers(4, 12), block_size=st.sampled_from([2, 4]),
       budget=st.integers(2, 12), max_num_seqs=st.integers(1, 5), caching=st.booleans(),
       policy=st.sampled_from(["fcfs", "priority"]), host_blocks=st.sampled_from([0, 0, 3]))
def test_random_workload_invariants_with_draft_tokens(ops, num_blocks, block_size, budget, max_num_seqs, caching,
                                                      policy, host_blocks):
    """Speculative decoding (never overlapped, as in the engine): random drafts, random acceptance;
    with either policy and with or without the host tier (rolled-back blocks never reach it)."""
    h = Harness(num_blocks, block_size, budget, max_num_seqs, caching, policy=policy, host_blocks=host_blocks,
                spec=True)
    _run(h, ops)
    if h.sched.num_preemptions:
        event("preempted (with drafts)")
    target(float(h.num_verified), label="verifications")
    target(float(h.sched.num_preemptions), label="preemptions")


def _run(h: Harness, ops) -> None:
    for op, *args in ops:
        if op == "add":
            h.add(*args)
        elif op == "step":
            h.step(*args)
        elif op == "drain":
            h.drain()
        elif h.request_ids:
            h.sched.abort(h.request_ids[args[0] % len(h.request_ids)])
            h._check_state()
    for i in range(3000):  # every request finishes: bounded, not "eventually"
        if not h.sched.has_unfinished_seqs() and h.pending is None:
            break
        h.step(i)
    h.check_finished()
