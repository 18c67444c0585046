"""Turns speculation down for a sequence whose drafts keep being rejected. No torch.

Verifying k drafts costs a forward over k + 1 rows instead of 1; it pays only when enough of
them are accepted. Per sequence the guard keeps a moving average of the drafts accepted per
verification. Below `MIN_MEAN_ACCEPTED` the sequence gets no drafts for a cool-down (counted in
its steps) that doubles each time it trips, from `MIN_COOLDOWN_STEPS` to `MAX_COOLDOWN_STEPS`;
then it probes again from a fresh average. Text that stops copying (random text) so costs a few
failed verifications per `MAX_COOLDOWN_STEPS` steps, while text that copies keeps its drafts.
The cool-down shrinks back to the minimum once the average is healthy again.

    average:  1.0 -> 0 accepted -> 0.75 -> 0 -> 0.56 -> 0 -> 0.42 < 0.5: off for 8 steps, then 16, ...
"""
from __future__ import annotations

from dataclasses import dataclass

MIN_MEAN_ACCEPTED = 0.5    # drafts accepted per verification below which speculation pauses
EMA_WEIGHT = 0.25          # weight of the newest verification in the moving average
PROBE_MEAN = 1.0           # where the average starts, and restarts after a cool-down
MIN_COOLDOWN_STEPS = 8
MAX_COOLDOWN_STEPS = 128


@dataclass
class _SeqState:
    mean_accepted: float = PROBE_MEAN
    cooldown: int = 0                      # steps left without drafts
    next_cooldown: int = MIN_COOLDOWN_STEPS


class AcceptanceGuard:
    def __init__(self):
        self._states: dict[int, _SeqState] = {}  # seq_id -> state, for running sequences only

    def is_paused(self, seq_id: int) -> bool:
        """Whether the sequence is in a cool-down (no count taken: the engine asks before a step)."""
        state = self._states.get(seq_id)
        return state is not None and state.cooldown > 0

    def wants_draft(self, seq_id: int) -> bool:
        """Whether to propose for this sequence this step (counts down its cool-down)."""
        state = self._states.get(seq_id)
        if state is None or state.cooldown == 0:
            return True
        state.cooldown -= 1
        return False

    def observe(self, seq_id: int, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """One verification of `num_draft_tokens` drafts, `num_accepted_tokens` of them accepted."""
        if num_draft_tokens == 0:
            return
        self._update(seq_id, num_accepted_tokens)

    def observe_no_draft(self, seq_id: int) -> None:
        """A proposal that found nothing, counted as a verification with none accepted (overlapped
        scheduling: asking costs a wait for the previous step, so it is paused like a bad draft)."""
        self._update(seq_id, 0)

    def _update(self, seq_id: int, num_accepted_tokens: int) -> None:
        state = self._states.setdefault(seq_id, _SeqState())
        state.mean_accepted += EMA_WEIGHT * (num_accepted_tokens - state.mean_accepted)
        if state.mean_accepted < MIN_MEAN_ACCEPTED:
            state.cooldown = state.next_cooldown
            state.next_cooldown = min(2 * state.next_cooldown, MAX_COOLDOWN_STEPS)
            state.mean_accepted = PROBE_MEAN
        elif state.mean_accepted >= PROBE_MEAN:
            state.next_cooldown = MIN_COOLDOWN_STEPS

    def retain(self, seq_ids: set[int]) -> None:
        """Forget every sequence not in `seq_ids` (finished, aborted or preempted)."""
        for seq_id in [s for s in self._states if s not in seq_ids]:
            del self._states[seq_id]
