"""The scheduler's waiting queue, one class per scheduling policy (vLLM's `SchedulingPolicy`). No torch.

    fcfs      first come, first served: arrival order; a preempted sequence goes back to the front
    priority  lower `priority` value first, arrival order within a level (vLLM's semantics);
              a preempted sequence goes back to its place by that key

The policy is chosen once (`create_request_queue`); the queue also answers the two questions
whose answer depends on it, so the scheduler never asks which policy it runs:

    insert_running(running, seq)   where an admitted sequence goes in the running list, whose
                                   last entry is the first to be preempted under KV pressure
    preempts(seq, victim)          may waiting `seq` preempt running `victim` to be admitted?

Under fcfs the running list is in admission order (the newest is preempted first) and a waiting
sequence never preempts. Under priority it is kept sorted by (priority, arrival_time), so its
last entry is the lowest-priority, latest-arrived sequence: vLLM's victim,
`max(running, key=(priority, arrival_time))`. A waiting sequence preempts a running one only if
its priority is strictly higher (a lower value): equal levels never ping-pong.
"""
from __future__ import annotations

import bisect
import enum
import heapq
from collections import deque
from typing import Iterator

from engine.core.sequence import Sequence


class SchedulingPolicy(enum.Enum):
    FCFS = "fcfs"
    PRIORITY = "priority"


def priority_key(seq: Sequence) -> tuple[int, float, int]:
    """Order under the priority policy: level, then arrival; seq_id breaks ties (an n > 1
    request's sequences share an arrival time and keep their index order)."""
    return seq.priority, seq.arrival_time, seq.seq_id


class FCFSRequestQueue(deque):
    """Arrival order. A plain deque, so `list(queue)` is the order sequences are admitted in."""

    def add_request(self, seq: Sequence) -> None:
        self.append(seq)

    def prepend_request(self, seq: Sequence) -> None:
        self.appendleft(seq)

    def prepend_requests(self, seqs: list[Sequence]) -> None:
        """Put `seqs` back at the front, in their order."""
        self.extendleft(reversed(seqs))

    def peek_request(self) -> Sequence:
        return self[0]

    def pop_request(self) -> Sequence:
        return self.popleft()

    @staticmethod
    def insert_running(running: list[Sequence], seq: Sequence) -> None:
        running.append(seq)

    @staticmethod
    def preempts(seq: Sequence, victim: Sequence) -> bool:
        return False


class PriorityRequestQueue:
    """A heap on `priority_key`; iterating gives the admission order (sorted)."""

    def __init__(self):
        self._heap: list[tuple[tuple[int, float, int], Sequence]] = []

    def add_request(self, seq: Sequence) -> None:
        heapq.heappush(self._heap, (priority_key(seq), seq))

    # A sequence's place is its key, wherever it comes back from (preempted, or skipped this step).
    prepend_request = add_request

    def prepend_requests(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            self.add_request(seq)

    def peek_request(self) -> Sequence:
        return self._heap[0][1]

    def pop_request(self) -> Sequence:
        return heapq.heappop(self._heap)[1]

    def remove(self, seq: Sequence) -> None:
        """ValueError if `seq` is not queued (as list.remove)."""
        i = next((i for i, (_, s) in enumerate(self._heap) if s is seq), None)
        if i is None:
            raise ValueError(f"{seq} is not in the waiting queue")
        self._heap[i] = self._heap[-1]
        self._heap.pop()
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __iter__(self) -> Iterator[Sequence]:
        return (seq for _, seq in sorted(self._heap, key=lambda entry: entry[0]))

    @staticmethod
    def insert_running(running: list[Sequence], seq: Sequence) -> None:
        bisect.insort(running, seq, key=priority_key)

    @staticmethod
    def preempts(seq: Sequence, victim: Sequence) -> bool:
        return seq.priority < victim.priority


RequestQueue = FCFSRequestQueue | PriorityRequestQueue


def create_request_queue(policy: SchedulingPolicy | str) -> RequestQueue:
    """The waiting queue of `policy` ("fcfs" or "priority"); ValueError naming any other."""
    try:
        policy = SchedulingPolicy(policy)
    except ValueError:
        choices = tuple(p.value for p in SchedulingPolicy)
        raise ValueError(f"scheduling_policy={policy!r} is invalid: choose one of {choices}") from None
    return FCFSRequestQueue() if policy is SchedulingPolicy.FCFS else PriorityRequestQueue()
