"""Per-request sampling parameters, with the ranges and defaults of vLLM / OpenAI.

Validated once, here, with `InvalidRequestError`s (ValueErrors) that name the field and the
value, in the message and in `param`, so nothing downstream has to re-check user input.
"""
from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from typing import Any

from engine.errors import InvalidRequestError

MAX_LOGPROBS = 20  # OpenAI's cap on top_logprobs (serve_app/http/protocol.py checks against it too)


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0  # every output carries all text/tokens so far
    DELTA = 1       # every output carries only what is new since the last one
    FINAL_ONLY = 2  # one output, when the request finishes


@dataclass
class StructuredOutputsParams:
    """A structured-output constraint (vLLM's name). Exactly one of the fields is set."""

    json: dict | str | None = None  # a JSON Schema (dict or its JSON text)
    json_object: bool = False        # any JSON object

    def __post_init__(self) -> None:
        if (self.json is None) == (not self.json_object):
            raise InvalidRequestError("StructuredOutputsParams needs exactly one of json=<schema> or json_object=True",
                                      param="structured_outputs")
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except json.JSONDecodeError as e:
                raise InvalidRequestError(f"structured_outputs.json is not valid JSON: {e}",
                                          param="structured_outputs.json") from None
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise InvalidRequestError(f"structured_outputs.json must be a JSON Schema object, "
                                      f"got {type(self.json).__name__}", param="structured_outputs.json")

    def key(self) -> str:
        """A stable cache key for the compiled grammar."""
        if self.json_object:
            return "json_object"
        return "json:" + json.dumps(self.json, sort_keys=True, separators=(",", ":"))


@dataclass
class SamplingParams:
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    logprobs: int | None = None  # top-k logprobs of each sampled token (plus the sampled one)
    prompt_logprobs: int | None = None  # top-k logprobs at each prompt position (plus the prompt token)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    extra_args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        _check(isinstance(self.n, int) and self.n >= 1, "n", self.n, "must be an integer >= 1")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", self.presence_penalty, "must be in [-2, 2]")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", self.frequency_penalty, "must be in [-2, 2]")
        _check(self.repetition_penalty > 0.0, "repetition_penalty", self.repetition_penalty, "must be > 0")
        _check(self.temperature >= 0.0, "temperature", self.temperature, "must be >= 0")
        _check(0.0 < self.top_p <= 1.0, "top_p", self.top_p, "must be in (0, 1]")
        _check(isinstance(self.top_k, int) and self.top_k >= 0, "top_k", self.top_k, "must be 0/-1 (disabled) or >= 1")
        _check(0.0 <= self.min_p <= 1.0, "min_p", self.min_p, "must be in [0, 1]")
        _check(self.seed is None or isinstance(self.seed, int), "seed", self.seed, "must be an integer")
        _check(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
               "max_tokens", self.max_tokens, "must be an integer >= 1")
        _check(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens", self.min_tokens, "must be >= 0")
        if self.max_tokens is not None:
            _check(self.min_tokens <= self.max_tokens, "min_tokens", self.min_tokens,
                   f"must be <= max_tokens={self.max_tokens}")
        _check(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS),
               "logprobs", self.logprobs, f"must be an integer in [0, {MAX_LOGPROBS}]")
        _check(self.prompt_logprobs is None
               or (type(self.prompt_logprobs) is int and 0 <= self.prompt_logprobs <= MAX_LOGPROBS),
               "prompt_logprobs", self.prompt_logprobs, f"must be an integer in [0, {MAX_LOGPROBS}]")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", self.stop, "must be non-empty strings")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
               "stop_token_ids", self.stop_token_ids, "must be non-negative integers")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def clone(self) -> "SamplingParams":
        import copy
        return copy.deepcopy(self)


def _check(ok: bool, name: str, value: Any, why: str) -> None:
    if not ok:
        raise InvalidRequestError(f"{name}={value!r} is invalid: {why}", param=name)
