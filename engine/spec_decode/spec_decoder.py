"""The engine's side of speculative decoding: drafts before a step, bookkeeping after it. No torch.

    step N:  schedule (drafts take lookahead slots) -> SpecDecoder.attach_draft_probs (their q)
             -> forward over k + 1 rows -> rejection sampler
             -> update_from_output (accepted drafts + 1 token; rejected slots rolled back)
             -> SpecDecoder.record (counters, acceptance guard) -> SpecDecoder.propose (drafts for N+1)

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
    def __init__(self, proposer: Proposer, num_speculative_tokens: int):
        self.proposer = proposer
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
        live = {seq.seq_id for seq in running}
        self.guard.retain(live)
        self.proposer.retain(live)
        self._draft_probs = {}
        asking = []
        for seq in running:
            seq.spec_token_ids = []
            if seq.num_computed_tokens + 1 == seq.num_tokens and self.guard.wants_draft(seq.seq_id):
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
            seq.spec_token_ids = draft

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

    def attach_draft_probs(self, scheduler_output: SchedulerOutput) -> None:
        pass

    def record(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> None:
        pass

    def get_stats(self) -> dict[str, float]:
        return {}
