"""The engine's side of speculative decoding: drafts before a step, bookkeeping after it. No torch.

    step N:  SpecDecoder.propose (drafts from the tokens so far) -> schedule (drafts take
             lookahead slots) -> SpecDecoder.attach_draft_probs (their q)
             -> forward over k + 1 rows -> rejection sampler
             -> update_from_output (accepted drafts + 1 token; rejected slots rolled back)
             -> SpecDecoder.record (counters, acceptance guard)
             -> SpecDecoder.retain (finished and preempted sequences' state dropped)

With overlapped scheduling a step is scheduled while the previous one runs, so its sequences'
last tokens are not on the host yet and nobody can propose after them. `needs_previous_tokens`
says when the engine must wait for the previous step first: when it verified drafts (the
accepted count moves every one of its sequences) or when a sequence that decodes next may get
drafts (the acceptance guard has not paused it). Steps in which every sequence is paused (text
that does not copy) overlap as without speculation.

Chosen once by `make_spec_decoder` (engine/spec_decode/__init__.py): `NoSpecDecoder` when
speculation is off, so the engine never asks which it has.
"""
from __future__ import annotations

from typing import Any, Protocol

from engine.core.messages import ModelRunnerOutput, SchedulerOutput
from engine.core.sequence import Sequence
from engine.core.stats import SpecDecodingStats
from engine.spec_decode.acceptance_guard import AcceptanceGuard


class Proposer(Protocol):
    def propose(self, seqs: list[Sequence]) -> list[list[int]]:
        """A draft (maybe empty) for each sequence, from its tokens so far."""

    def take_draft_probs(self) -> dict[int, Any]:
        """The last proposal's q, handed over once: seq_id -> torch.Tensor [len(draft), vocab] for
        each draft sampled from a distribution; none for deterministic drafts (n-gram, argmax)."""

    def retain(self, seq_ids: set[int]) -> None:
        """Forget the state of every sequence not in `seq_ids`."""


class SpecDecoder:
    def __init__(self, proposer: Proposer, num_speculative_tokens: int, pause_without_drafts: bool = False):
        self.proposer = proposer
        # With overlapped scheduling each proposal costs a wait, so one that finds nothing
        # pauses the sequence as a rejected draft does (AcceptanceGuard.observe_no_draft).
        self.pause_without_drafts = pause_without_drafts
        self.guard = AcceptanceGuard()
        self.stats = SpecDecodingStats(num_speculative_tokens)
        # q of the drafts proposed for the next step: seq_id -> torch.Tensor [len(draft), vocab].
        # Lives as long as the drafts in `Sequence.spec_token_ids`: until the next step's schedule.
        self._draft_probs: dict[int, Any] = {}

    def propose(self, running: list[Sequence]) -> None:
        """Give every running sequence that decodes next its drafts (`spec_token_ids`; [] for the rest),
        unless the acceptance guard has paused it, and keep the q of those sampled from one. A grammar
        cuts a draft at its first token the grammar refuses (the matcher is left as it was), and its
        draft keeps no q (verified one-hot): a cut that depends on tokens drawn from q would bias
        q's acceptance test."""
        self._draft_probs = {}
        asking = []
        for seq in running:
            seq.spec_token_ids = []
            # The guard first: a cool-down counts every step of a running sequence, also one whose
            # last token is still in flight (overlapped scheduling), which gets no draft.
            if self.guard.wants_draft(seq.seq_id) and seq.num_computed_tokens + 1 == seq.num_tokens:
                asking.append(seq)
        if not asking:
            return
        drafts = self.proposer.propose(asking)
        probs = self.proposer.take_draft_probs()
        for seq, draft in zip(asking, drafts):
            if seq.grammar is not None:  # no q kept, cut or not
                if draft:
                    draft = draft[:seq.grammar.draft_prefix(draft)]
            elif seq.seq_id in probs:
                self._draft_probs[seq.seq_id] = probs[seq.seq_id]
            if not draft and self.pause_without_drafts:
                self.guard.observe_no_draft(seq.seq_id)
            seq.spec_token_ids = draft

    def retain(self, running: list[Sequence]) -> None:
        """Forget the guard's and the proposer's state of every sequence no longer running (after each step)."""
        live = {seq.seq_id for seq in running}
        self.guard.retain(live)
        self.proposer.retain(live)

    def needs_previous_tokens(self, running: list[Sequence], inflight: SchedulerOutput) -> bool:
        """Whether the next step must wait for the in-flight one's tokens before its proposals."""
        if inflight.spec_token_ids:
            return True
        return any(seq.num_output_placeholders and not self.guard.is_paused(seq.seq_id) for seq in running)

    def attach_draft_probs(self, scheduler_output: SchedulerOutput) -> None:
        """Give a just-scheduled step the q of its drafts (`spec_draft_probs`): the first
        len(drafts) rows, as the scheduler may have cut a draft to what fits. Called between
        schedule() and the forward; the rest of this proposal's q is dropped (its drafts are stale)."""
        probs, self._draft_probs = self._draft_probs, {}
        for seq_id, drafts in scheduler_output.spec_token_ids.items():
            q = probs.get(seq_id)
            if q is not None:
                scheduler_output.spec_draft_probs[seq_id] = q[:len(drafts)]

    def record(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> None:
        """Count one step's verifications and feed them to the acceptance guard."""
        spec = scheduler_output.spec_token_ids
        if not spec:
            return
        for seq, num_accepted in zip(scheduler_output.sampled_seqs, runner_output.num_accepted_tokens):
            drafts = spec.get(seq.seq_id)
            if drafts:
                self.stats.observe(len(drafts), num_accepted)
                self.guard.observe(seq.seq_id, len(drafts), num_accepted)

    def get_stats(self) -> dict[str, float]:
        return self.stats.as_dict()


class NoSpecDecoder:
    """Speculation off: no drafts, nothing to count."""

    def propose(self, running: list[Sequence]) -> None:
        pass

    def retain(self, running: list[Sequence]) -> None:
        pass

    def needs_previous_tokens(self, running: list[Sequence], inflight: SchedulerOutput) -> bool:
        return False

    def attach_draft_probs(self, scheduler_output: SchedulerOutput) -> None:
        pass

    def record(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> None:
        pass

    def get_stats(self) -> dict[str, float]:
        return {}
