"""What the engine observes per step and per finished request, for a metrics exporter to record.

    LLMEngine --(records into)--> StatsLog --take()--> IterationStats --> exporter (serve_app/metrics.py)

The same facts as vLLM's `IterationStats` / `FinishedRequestStats` (vllm/v1/metrics/stats.py), so
the exported series mean what they mean in vLLM. The engine only collects plain numbers; it
imports no metrics library. Collection is off until someone enables it (AsyncLLM does): an
offline `LLM` that nobody drains must not grow a list per generated token.

Times are `time.monotonic()` seconds. Per request, as in vLLM v1:

    arrival ---queued---> scheduled ---prefill---> first token ---decode---> last token
    |<------------------------------------- e2e --------------------------------------->|
                          |<-------------------- inference ------------------------->|
"""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.outputs import RequestMetrics


@dataclass
class FinishedRequestStats:
    finish_reason: str             # "stop" | "length" | "abort" (of the request's first completion)
    e2e_latency: float             # arrival -> finished
    queued_time: float             # arrival -> first scheduled (0 if never scheduled: aborted in the queue)
    prefill_time: float            # first scheduled -> first token
    decode_time: float             # first token -> last token
    inference_time: float          # first scheduled -> last token
    num_prompt_tokens: int
    num_generation_tokens: int     # over all n completions
    time_per_output_token: float | None  # decode_time / (tokens of completion 0 - 1); None for < 2 tokens


@dataclass
class IterationStats:
    """Observations since the previous `StatsLog.take()`."""

    num_prompt_tokens: int = 0     # prompts that reached their first token (cached tokens included, as vLLM)
    num_generation_tokens: int = 0
    iteration_tokens: list[int] = field(default_factory=list)          # tokens scheduled per engine step
    time_to_first_tokens: list[float] = field(default_factory=list)    # arrival -> first token, per request
    inter_token_latencies: list[float] = field(default_factory=list)   # per request and step that gave it tokens
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not (self.iteration_tokens or self.time_to_first_tokens or self.finished_requests)


class StatsLog:
    """Accumulates IterationStats on the engine's thread; `take()` hands them over and starts afresh."""

    def __init__(self) -> None:
        self.enabled = False
        self._current = IterationStats()

    def take(self) -> IterationStats:
        current, self._current = self._current, IterationStats()
        return current

    def on_step(self, num_scheduled_tokens: int) -> None:
        if self.enabled:
            self._current.iteration_tokens.append(num_scheduled_tokens)

    def on_scheduled(self, metrics: RequestMetrics, now: float) -> None:
        if metrics.scheduled_time is None:  # the first time only: a preempted request keeps its queue time
            metrics.scheduled_time = now

    def on_new_tokens(self, metrics: RequestMetrics, num_prompt_tokens: int, num_new_tokens: int,
                      now: float) -> None:
        """A request got `num_new_tokens` this step (over its completions); call before first_token_time is set."""
        if self.enabled:
            cur = self._current
            cur.num_generation_tokens += num_new_tokens
            if metrics.first_token_time is None:
                cur.num_prompt_tokens += num_prompt_tokens
                cur.time_to_first_tokens.append(now - metrics.arrival_time)
            elif metrics.last_token_time is not None:
                cur.inter_token_latencies.append(now - metrics.last_token_time)
        metrics.last_token_time = now

    def on_finished(self, metrics: RequestMetrics, finish_reason: str, num_prompt_tokens: int,
                    num_tokens: list[int], now: float) -> None:
        """`num_tokens`: generated tokens of each completion."""
        if not self.enabled:
            return
        scheduled = metrics.scheduled_time if metrics.scheduled_time is not None else now
        first = metrics.first_token_time if metrics.first_token_time is not None else now
        last = metrics.last_token_time if metrics.last_token_time is not None else now
        decode = max(last - first, 0.0)
        tpot = decode / (num_tokens[0] - 1) if num_tokens and num_tokens[0] > 1 else None
        self._current.finished_requests.append(FinishedRequestStats(
            finish_reason=finish_reason, e2e_latency=now - metrics.arrival_time,
            queued_time=scheduled - metrics.arrival_time, prefill_time=max(first - scheduled, 0.0),
            decode_time=decode, inference_time=max(last - scheduled, 0.0), num_prompt_tokens=num_prompt_tokens,
            num_generation_tokens=sum(num_tokens), time_per_output_token=tpot))


@dataclass
class SpecDecodingStats:
    """Speculative decoding's lifetime counters, with vLLM's names and meanings (a draft is one
    sequence's drafts verified in one step; accepted tokens exclude the bonus token)."""

    num_spec_tokens: int                 # k: drafts per step at most
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)  # [k]: accepted at position i

    def __post_init__(self) -> None:
        if not self.num_accepted_tokens_per_pos:
            self.num_accepted_tokens_per_pos = [0] * self.num_spec_tokens

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for i in range(num_accepted_tokens):  # the accepted ones are a prefix: positions 0 .. n - 1
            self.num_accepted_tokens_per_pos[i] += 1

    def as_dict(self) -> dict[str, float]:
        """get_stats()'s keys: spec_decode_num_drafts, ..., spec_decode_num_accepted_tokens_per_pos_<i>."""
        out = {"spec_decode_num_drafts": self.num_drafts, "spec_decode_num_draft_tokens": self.num_draft_tokens,
               "spec_decode_num_accepted_tokens": self.num_accepted_tokens}
        for i, n in enumerate(self.num_accepted_tokens_per_pos):
            out[f"{SPEC_DECODE_PER_POS_KEY}{i}"] = n
        return out


SPEC_DECODE_PER_POS_KEY = "spec_decode_num_accepted_tokens_per_pos_"  # + position, in get_stats()
