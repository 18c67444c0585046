"""The engine's side of speculative decoding: drafts before a step, bookkeeping after it. No torch.

    step N:  schedule (drafts take lookahead slots) -> forward over k + 1 rows -> rejection sampler
             -> update_from_output (accepted drafts + 1 token; rejected slots rolled back)
             -> SpecDecoder.record (counters, acceptance guard) -> SpecDecoder.propose (drafts for N+1)

Chosen once by `make_spec_decoder` (engine/spec_decode/__init__.py): `NoSpecDecoder` when
speculation is off, so the engine never asks which it has.
"""
from __future__ import annotations

from typing import Protocol

from engine.core.messages import ModelRunnerOutput, SchedulerOutput
from engine.core.sequence import Sequence
from engine.core.stats import SpecDecodingStats
from engine.spec_decode.acceptance_guard import AcceptanceGuard


class Proposer(Protocol):
    def propose(self, seqs: list[Sequence]) -> list[list[int]]:
        """A draft (maybe empty) for each sequence, from its tokens so far."""

    def retain(self, seq_ids: set[int]) -> None:
        """Forget the state of every sequence not in `seq_ids`."""


class SpecDecoder:
    def __init__(self, proposer: Proposer, num_speculative_tokens: int):
        self.proposer = proposer
        self.guard = AcceptanceGuard()
        self.stats = SpecDecodingStats(num_speculative_tokens)

    def propose(self, running: list[Sequence]) -> None:
        """Give every running sequence that decodes next its drafts (`spec_token_ids`; [] for the rest),
        unless the acceptance guard has paused it. A grammar cuts a draft at its first token the
        grammar refuses (the matcher is left as it was), and the cut draft is verified one-hot,
        without its q: a cut that depends on tokens drawn from q would bias q's acceptance test."""
        live = {seq.seq_id for seq in running}
        self.guard.retain(live)
        self.proposer.retain(live)
        asking = []
        for seq in running:
            seq.spec_token_ids = []
            if seq.num_computed_tokens + 1 == seq.num_tokens and self.guard.wants_draft(seq.seq_id):
                asking.append(seq)
        if asking:
            for seq, draft in zip(asking, self.proposer.propose(asking)):
                if seq.grammar is not None and draft:
                    draft = list(draft[:seq.grammar.draft_prefix(draft)])
                seq.spec_token_ids = draft

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

    def record(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> None:
        pass

    def get_stats(self) -> dict[str, float]:
        return {}
