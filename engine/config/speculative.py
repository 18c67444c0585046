"""SpeculativeConfig: vLLM's `speculative_config`, as a dataclass of plain values. Torch-free.

    LLM(model, speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                   "prompt_lookup_max": 4, "prompt_lookup_min": 2})

`method` picks the proposer (engine/spec_decode): "ngram" looks the request's last n tokens up
in its own prompt and output and proposes what followed them; "draft_model" runs the small
checkpoint named by `model` (same tokenizer and vocabulary as the target) for k greedy steps.
Either way each step verifies up to `num_speculative_tokens` (k) proposed tokens in one forward
of the target model. docs/spec_decode.md.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from engine.errors import check_int

SPECULATIVE_METHODS = ("ngram", "draft_model")
# vLLM's default n-gram window when neither bound is given (vllm/config/speculative.py).
DEFAULT_PROMPT_LOOKUP = 5


@dataclass
class SpeculativeConfig:
    # "ngram" | "draft_model"; None: "draft_model" when `model` names a checkpoint (vLLM's rule;
    # model="ngram" also means the n-gram method).
    method: str | None = None
    num_speculative_tokens: int | None = None  # k, required: tokens proposed and verified per step
    # n-gram: the longest suffix of n tokens, prompt_lookup_min <= n <= prompt_lookup_max, that occurs
    # earlier in the request; a missing bound takes the other's value (both missing: 5, as vLLM).
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    model: str | None = None  # draft_model: a local directory or hub id of the draft checkpoint

    def __post_init__(self) -> None:
        if self.model in ("ngram", "[ngram]") and self.method in (None, "ngram"):
            self.method, self.model = "ngram", None
        if self.method is None:
            if self.model is None:
                raise ValueError("speculative_config: set method (one of "
                                 f"{SPECULATIVE_METHODS}) or model (a draft checkpoint)")
            self.method = "draft_model"
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config.method={self.method!r} is invalid: "
                             f"choose one of {SPECULATIVE_METHODS}")
        if self.num_speculative_tokens is None:
            raise ValueError("speculative_config.num_speculative_tokens is required (tokens proposed per step)")
        check_int("speculative_config.num_speculative_tokens", self.num_speculative_tokens)
        if self.method == "ngram":
            self._check_prompt_lookup()
        elif not isinstance(self.model, str) or not self.model:
            raise ValueError(f"speculative_config.model={self.model!r} is invalid: method 'draft_model' "
                             "needs the draft checkpoint's path or hub id")

    def _check_prompt_lookup(self) -> None:
        if self.model is not None:
            raise ValueError(f"speculative_config.model={self.model!r} is invalid with method 'ngram' "
                             "(it proposes from the request's own tokens)")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is None and hi is None:
            lo = hi = DEFAULT_PROMPT_LOOKUP
        lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)
        check_int("speculative_config.prompt_lookup_min", lo)
        check_int("speculative_config.prompt_lookup_max", hi)
        if lo > hi:
            raise ValueError(f"speculative_config.prompt_lookup_min={lo} is invalid: must be <= "
                             f"prompt_lookup_max={hi}")
        self.prompt_lookup_min, self.prompt_lookup_max = lo, hi

    @classmethod
    def from_value(cls, value: Any) -> SpeculativeConfig | None:
        """A SpeculativeConfig from what a caller passed: one, a dict of its fields (vLLM's form), or None."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config={value!r} is invalid: pass a dict such as "
                             "{'method': 'ngram', 'num_speculative_tokens': 4}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise ValueError(f"speculative_config: unknown field(s) {unknown}; known: {sorted(names)}")
        return cls(**value)
