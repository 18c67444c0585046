"""What callers get back: `RequestOutput` and its parts, as vLLM's `vllm.outputs`.

    LLMEngine --RequestOutput--> LLM / AsyncLLM callers

The messages between the engine's own stages are in engine/core/messages.py.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.lora.request import LoRARequest


@dataclass
class Logprob:
    """vLLM's per-token logprob record."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int                      # which of the request's n completions
    text: str                       # generated text (stop strings excluded unless asked)
    token_ids: list[int]            # generated token ids
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None  # per generated token: sampled + top-k
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or stop token id, when finish_reason == "stop"

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """A request's timeline, in time.monotonic() seconds (engine/core/stats.py draws it)."""

    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    scheduled_time: float | None = None   # first scheduled (a preemption does not reset it)
    last_token_time: float | None = None  # the latest step that gave the request a token
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    # When prompt_logprobs was asked for: one entry per prompt token, the first None (no context),
    # else {prompt token: Logprob, plus the top-k}. DELTA outputs carry it once, when complete.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    lora_request: LoRARequest | None = None  # the adapter it ran with (docs/lora.md); None: the base model

    def add(self, next_output: "RequestOutput") -> None:
        """Append a later DELTA output of the same request to this one (the reader was behind).

        Per completion index the new text, token ids and logprobs are concatenated and the
        latest finish state wins; the request-level fields come from the later output.
        """
        by_index = {c.index: c for c in self.outputs}
        for c in next_output.outputs:
            mine = by_index.get(c.index)
            if mine is None:
                self.outputs.append(c)
                self.outputs.sort(key=lambda o: o.index)
                by_index[c.index] = c
                continue
            mine.text += c.text
            mine.token_ids = mine.token_ids + c.token_ids
            if c.logprobs is not None:
                mine.logprobs = (mine.logprobs or []) + c.logprobs
            mine.cumulative_logprob = c.cumulative_logprob
            mine.finish_reason, mine.stop_reason = c.finish_reason, c.stop_reason
        if self.prompt_logprobs is None:  # a DELTA stream carries them once
            self.prompt_logprobs = next_output.prompt_logprobs
        self.finished = next_output.finished
        self.metrics = next_output.metrics
        self.num_cached_tokens = next_output.num_cached_tokens
