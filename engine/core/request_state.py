"""Per-request bookkeeping between the scheduler's sequences and the caller's RequestOutputs."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.detokenizer import IncrementalDetokenizer, decode_token
from engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from engine.sampling_params import RequestOutputKind, SamplingParams
from engine.core.sequence import Sequence


@dataclass
class _Sent:
    """How much of one completion the caller has already received (for DELTA outputs)."""

    num_tokens: int = 0
    num_chars: int = 0


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    detokenizers: list[IncrementalDetokenizer]
    metrics: RequestMetrics
    sent: list[_Sent] = field(default_factory=list)
    # RequestOutput.prompt_logprobs, built once when complete; DELTA outputs send it once.
    prompt_logprobs: list | None = None
    prompt_logprobs_sent: bool = False

    def __post_init__(self) -> None:
        self.sent = [_Sent() for _ in self.seqs]

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    def make_output(self, changed: set[int], tokenizer) -> RequestOutput | None:
        """The RequestOutput to hand out after a step, by the request's output kind (None: nothing to send)."""
        kind = self.params.output_kind
        finished = self.finished
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        delta = kind is RequestOutputKind.DELTA
        indices = sorted(changed) if delta else range(len(self.seqs))
        outputs = [self._completion(i, delta, tokenizer) for i in indices]
        prompt_logprobs = self._prompt_logprobs(tokenizer)
        if delta:  # as vLLM: a DELTA stream gets all prompt logprobs at once, in one output
            if self.prompt_logprobs_sent:
                prompt_logprobs = None
            self.prompt_logprobs_sent = prompt_logprobs is not None or self.prompt_logprobs_sent
        return RequestOutput(request_id=self.request_id, prompt=self.prompt,
                             prompt_token_ids=self.prompt_token_ids, outputs=outputs, finished=finished,
                             metrics=self.metrics, num_cached_tokens=self.metrics.num_cached_tokens,
                             prompt_logprobs=prompt_logprobs, lora_request=self.seqs[0].lora_request)

    def _prompt_logprobs(self, tokenizer) -> list | None:
        """vLLM's prompt_logprobs once completion 0 has scored the whole prompt, else None."""
        if self.prompt_logprobs is None and self.params.prompt_logprobs is not None:
            seq = self.seqs[0]
            if len(seq.prompt_logprobs) == seq.num_prompt_tokens - 1:
                self.prompt_logprobs = [None] + [_logprob_dict(e, tokenizer) for e in seq.prompt_logprobs]
        return self.prompt_logprobs

    def _completion(self, i: int, delta: bool, tokenizer) -> CompletionOutput:
        seq, detok, sent = self.seqs[i], self.detokenizers[i], self.sent[i]
        token_ids = seq.output_token_ids
        text = detok.get_next_output_text(seq.is_finished, delta)
        start = sent.num_tokens if delta else 0
        logprobs = None
        if self.params.logprobs is not None:
            logprobs = [_logprob_dict(e, tokenizer) for e in seq.output_logprobs[start:]]
        cumulative = None
        if seq.output_logprobs:
            cumulative = sum(e.logprob for e in seq.output_logprobs)
        sent.num_tokens = len(token_ids)
        return CompletionOutput(index=seq.index, text=text, token_ids=token_ids[start:],
                                cumulative_logprob=cumulative, logprobs=logprobs,
                                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason)


def _logprob_dict(entry, tokenizer) -> dict[int, Logprob]:
    """vLLM's shape: the sampled token first, then the top-k (the sampled one may be among them)."""
    out = {entry.token_id: Logprob(entry.logprob, entry.rank, decode_token(tokenizer, entry.token_id))}
    for rank, (tid, lp) in enumerate(zip(entry.top_token_ids, entry.top_logprobs), start=1):
        if tid not in out:
            out[tid] = Logprob(lp, rank, decode_token(tokenizer, tid))
    return out
