"""Scheduler under scheduling_policy="priority" (engine/core/request_queue.py): admission order,
preemption victims and waiting-request preemption, each as exact orders and block ids.

Block size 4, a fake model that samples TOK, as in tests/test_scheduler.py.
"""
from __future__ import annotations

import pytest

from engine.core.block_manager import BlockManager
from engine.core.messages import ModelRunnerOutput
from engine.core.request_queue import PriorityRequestQueue, create_request_queue
from engine.core.scheduler import Scheduler
from engine.core.sequence import Sequence, SequenceStatus
from engine.sampling_params import SamplingParams

BS, EOS, TOK = 4, 2, 7


def make_sched(policy, num_blocks=32, max_num_seqs=8, max_num_batched_tokens=64) -> Scheduler:
    return Scheduler(max_num_seqs, max_num_batched_tokens, 64, BlockManager(num_blocks, BS), [EOS], policy=policy)


def make_seq(rid: str, prompt_len: int, priority: int = 0, arrival: float = 0.0, max_tokens: int = 4) -> Sequence:
    base = 1000 * (1 + sum(map(ord, rid)))  # tokens unique to rid: no accidental prefix hits
    return Sequence(rid, list(range(base, base + prompt_len)), SamplingParams(max_tokens=max_tokens),
                    arrival_time=arrival, priority=priority)


FINISHED: list[str] = []  # request ids in the order step() saw them finish (reset by each test)


@pytest.fixture(autouse=True)
def _reset_finished():
    FINISHED.clear()


def step(sched: Scheduler):
    """schedule() + a fake runner + update_from_output(); returns the output and [(rid, tokens)]."""
    out = sched.schedule()
    scheduled = [(s.request_id, n) for s, n in zip(out.seqs, out.num_scheduled_tokens)]
    updated = sched.update_from_output(out, ModelRunnerOutput(sampled_token_ids=[TOK] * sum(out.sample_flags)))
    FINISHED.extend(s.request_id for s in updated if s.is_finished)
    return out, scheduled


def run_all(sched: Scheduler, max_steps: int = 100) -> list[str]:
    """Step until done; every request id in the order it finished (this test's steps so far included)."""
    for _ in range(max_steps):
        if not sched.has_unfinished_seqs():
            return list(FINISHED)
        step(sched)
    raise AssertionError("not finished")


def test_priority_queue_orders_by_level_then_arrival():
    q = create_request_queue("priority")
    seqs = [make_seq("a", 3, 1, 0.0), make_seq("b", 3, 0, 1.0), make_seq("c", 3, 1, 2.0), make_seq("d", 3, 0, 3.0)]
    for s in seqs:
        q.add_request(s)
    assert [s.request_id for s in q] == ["b", "d", "a", "c"]
    q.remove(seqs[3])
    assert q.pop_request() is seqs[1] and q.peek_request() is seqs[0] and len(q) == 2
    q.prepend_request(seqs[1])  # a sequence comes back (preempted) at its key's place, not the front
    assert [s.request_id for s in q] == ["b", "a", "c"]
    with pytest.raises(ValueError, match="not in the waiting queue"):
        q.remove(seqs[3])
    with pytest.raises(ValueError, match=r"scheduling_policy='lifo' is invalid: choose one of \('fcfs', 'priority'\)"):
        create_request_queue("lifo")
    assert isinstance(create_request_queue("priority"), PriorityRequestQueue)


def test_waiting_requests_are_admitted_by_priority():
    """One sequence slot: each step admits the best waiting request; arrival breaks ties."""
    sched = make_sched("priority", max_num_seqs=1)
    for rid, prio, t in [("low", 5, 0.0), ("high", 0, 1.0), ("mid", 2, 2.0), ("mid2", 2, 3.0)]:
        sched.add_seq(make_seq(rid, 3, prio, t, max_tokens=1))
    assert [step(sched)[1] for _ in range(4)] == [[("high", 3)], [("mid", 3)], [("mid2", 3)], [("low", 3)]]
    sched.block_manager.check_no_leak()


@pytest.mark.parametrize("policy, victim", [("fcfs", "c"), ("priority", "b")])
def test_kv_pressure_preempts_the_lowest_priority_then_the_latest(policy, victim):
    """6 blocks, three 8-token prompts (2 blocks each) admitted together; a's first decode needs
    a 3rd block. fcfs preempts the newest (c); priority preempts the lowest priority (b, p=2),
    though c arrived later. The others then get the victim's blocks, its tail first."""
    sched = make_sched(policy, num_blocks=6)
    prios = {"a": 0, "b": 2, "c": 1} if policy == "priority" else {"a": 0, "b": 0, "c": 0}
    seqs = {rid: make_seq(rid, 8, prios[rid], t, max_tokens=8) for t, rid in enumerate("abc")}
    for s in seqs.values():
        sched.add_seq(s)
    _, first = step(sched)
    admitted = ["a", "b", "c"] if policy == "fcfs" else ["a", "c", "b"]  # priority: by level
    assert first == [(rid, 8) for rid in admitted]
    held = {rid: list(s.block_table) for rid, s in seqs.items()}
    out, scheduled = step(sched)
    assert out.preempted == [seqs[victim]] and seqs[victim].status is SequenceStatus.WAITING
    others = [rid for rid in admitted if rid != victim]
    assert scheduled == [(rid, 1) for rid in others]
    # The victim's blocks went back tail first: the first decode that needs a block takes its last one.
    assert seqs["a"].block_table == held["a"] + [held[victim][1]]
    assert seqs[others[1]].block_table == held[others[1]] + [held[victim][0]]
    run_all(sched)
    sched.block_manager.check_no_leak()


def test_high_priority_request_preempts_a_full_batch_and_finishes_first():
    """max_num_seqs=2, both slots decoding low-priority requests: a high-priority arrival takes the
    slot of the lowest, latest one (its tokens this step given back to the budget), runs first
    in every step after, and finishes first. The same arrival under fcfs waits for a slot."""
    order = {}
    for policy in ("fcfs", "priority"):
        FINISHED.clear()
        low = 1 if policy == "priority" else 0  # fcfs: every request at 0, as the engine requires
        sched = make_sched(policy, max_num_seqs=2, max_num_batched_tokens=9)
        low1, low2 = make_seq("low1", 4, low, 0.0, max_tokens=6), make_seq("low2", 4, low, 1.0, max_tokens=6)
        sched.add_seq(low1)
        sched.add_seq(low2)
        step(sched)
        high = make_seq("high", 8, 0, 2.0, max_tokens=2)
        sched.add_seq(high)
        out, scheduled = step(sched)
        if policy == "priority":
            # low2 was scheduled (1 token) before high was looked at: unscheduled, its token given back,
            # so high's whole 8-token prompt fits the 9-token budget beside low1's decode.
            assert scheduled == [("low1", 1), ("high", 8)] and out.preempted == [low2]
            assert [s.request_id for s in sched.running] == ["high", "low1"]
            assert list(sched.waiting) == [low2] and low2.num_computed_tokens == 0
            assert step(sched)[1] == [("high", 1), ("low1", 1)]
        else:
            assert scheduled == [("low1", 1), ("low2", 1)] and not out.preempted and list(sched.waiting) == [high]
        order[policy] = run_all(sched)
        sched.block_manager.check_no_leak()
    assert order == {"fcfs": ["low1", "low2", "high"], "priority": ["high", "low1", "low2"]}


def test_waiting_request_preempts_only_strictly_lower_priorities_for_blocks():
    """8 blocks held by three running requests (p=1, 1, 3), 1 free. A p=1 arrival needing 4
    blocks preempts the p=3 one (its token this step given back) and still does not fit: the
    others are not lower, so it waits and nobody else is touched. A p=0 arrival needing 4 then
    preempts the latest p=1 one, is admitted, and nothing else is admitted in that step."""
    sched = make_sched("priority", num_blocks=8)
    r1, r2, r3 = make_seq("r1", 10, 1, 0.0), make_seq("r2", 6, 1, 1.0), make_seq("r3", 6, 3, 2.0)
    for s in (r1, r2, r3):
        sched.add_seq(s)
    step(sched)  # r1: 3 blocks, r2 and r3: 2 each, each with room for its next decodes
    assert [len(s.block_table) for s in (r1, r2, r3)] == [3, 2, 2] and sched.block_manager.get_num_free_blocks() == 1
    peer = make_seq("peer", 16, 1, 3.0, max_tokens=1)
    sched.add_seq(peer)
    out, scheduled = step(sched)
    assert out.preempted == [r3] and scheduled == [("r1", 1), ("r2", 1)]
    assert peer.status is SequenceStatus.WAITING and [s.request_id for s in sched.waiting] == ["peer", "r3"]
    assert sched.block_manager.get_num_free_blocks() == 3  # r3's blocks: kept in the prefix cache meanwhile
    urgent = make_seq("urgent", 16, 0, 4.0, max_tokens=1)
    sched.add_seq(urgent)
    out, scheduled = step(sched)
    assert out.preempted == [r2] and scheduled == [("r1", 1), ("urgent", 16)]
    # FIFO within a level: r2 arrived before peer, so it is back ahead of it.
    assert [s.request_id for s in sched.waiting] == ["r2", "peer", "r3"]
    assert run_all(sched)[0] == "urgent"
    assert [s.num_output_tokens for s in (r1, r2, r3, peer, urgent)] == [4, 4, 4, 1, 1]
    sched.block_manager.check_no_leak()
