"""A processed step's new tokens, on their way to the caller: one per sampled sequence, or
several with speculative decoding (accepted drafts, then the sampled token), of which a stop
string or a completed grammar may keep only the first ones, as decoding one token per step would.
"""
from __future__ import annotations

from engine.core.messages import ModelRunnerOutput, SchedulerOutput
from engine.core.sequence import Sequence


def detokenize_new_tokens(detokenizer, seq: Sequence) -> str | None:
    """Feed the step's new tokens; returns the stop string they completed, if any. With several
    tokens (accepted drafts) and stop strings, one token at a time, so that the tokens after
    the one completing a stop string are dropped, as decoding one token per step would."""
    new_token_ids = seq.token_ids[len(seq.token_ids) - seq.num_new_tokens:]
    if len(new_token_ids) == 1 or not detokenizer.stop:
        return detokenizer.update(new_token_ids)
    for i, token_id in enumerate(new_token_ids):
        stop_str = detokenizer.update([token_id])
        if stop_str is not None:
            drop_new_tokens(seq, len(new_token_ids) - i - 1)
            return stop_str
    return None


def drop_new_tokens(seq: Sequence, num_dropped: int) -> None:
    """Forget the last `num_dropped` tokens of a sequence that ends before them (and their logprobs)."""
    if num_dropped:
        del seq.token_ids[len(seq.token_ids) - num_dropped:]
        del seq.output_logprobs[seq.num_output_tokens:]
        seq.num_new_tokens -= num_dropped


def logprobs_by_seq(sched_out: SchedulerOutput, runner_out: ModelRunnerOutput) -> list[tuple[Sequence, list]]:
    """The logprob records of each sampled sequence not finished yet, in token order: its accepted
    drafts' (speculative decoding), then its sampled token's."""
    if runner_out.logprobs is None:
        return []
    accepted = runner_out.accepted_logprobs
    out = []
    for i, (seq, entry) in enumerate(zip(sched_out.sampled_seqs, runner_out.logprobs)):
        if entry is not None and not seq.is_finished:
            out.append((seq, accepted[i] + [entry] if accepted else [entry]))
    return out
