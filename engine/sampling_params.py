"""Per-request sampling parameters, with the ranges and defaults of vLLM / OpenAI.

Validated once, here, with `InvalidRequestError`s (ValueErrors) that name the field and the
value, in the message and in `param`, so nothing downstream has to re-check user input.
"""
from __future__ import annotations

import enum
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from engine.errors import InvalidRequestError

MAX_LOGPROBS = 20  # OpenAI's cap on top_logprobs (serve_app/http/protocol.py checks against it too)


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0  # every output carries all text/tokens so far
    DELTA = 1       # every output carries only what is new since the last one
    FINAL_ONLY = 2  # one output, when the request finishes


# The forms of structured output, in the order StructuredOutputsParams declares them.
STRUCTURED_OUTPUT_FORMS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class StructuredOutputsParams:
    """A structured-output constraint (vLLM's name and fields). Exactly one form is set.

    Checked here for shape only (this module is torch- and xgrammar-free: the HTTP tier imports
    it); the engine compiles the constraint when the request is added and refuses what xgrammar
    cannot compile, naming `structured_outputs.<form>`.
    """

    json: dict | str | None = None            # a JSON Schema (dict or its JSON text)
    regex: str | None = None                   # the output re.fullmatch-es it (Python `re` syntax)
    choice: list[str] | None = None            # the output is exactly one of these strings
    grammar: str | None = None                 # an EBNF/GBNF grammar as xgrammar takes it (root rule `root`)
    json_object: bool = False                  # any JSON object
    # xgrammar's structural tag, as JSON text or a dict: vLLM's {"type": "structural_tag",
    # "structures": [{"begin", "schema", "end"}], "triggers": [...]}, or {"type": "structural_tag", "format": {...}}
    structural_tag: str | dict | None = None

    def __post_init__(self) -> None:
        set_forms = [f for f in STRUCTURED_OUTPUT_FORMS if self._is_set(f)]
        if len(set_forms) != 1:
            got = f"got {' and '.join(set_forms)}" if set_forms else "got none"
            raise InvalidRequestError(f"StructuredOutputsParams needs exactly one of {', '.join(STRUCTURED_OUTPUT_FORMS)} "
                                      f"({got})", param="structured_outputs")
        getattr(self, f"_check_{self.form}")()

    def _is_set(self, form: str) -> bool:
        return self.json_object is True if form == "json_object" else getattr(self, form) is not None

    @property
    def form(self) -> str:
        """"json" | "regex" | "choice" | "grammar" | "json_object" | "structural_tag"."""
        return next(f for f in STRUCTURED_OUTPUT_FORMS if self._is_set(f))

    def key(self) -> str:
        """A stable cache key for the compiled grammar: the form and its canonical value."""
        if self.json_object:
            return "json_object"
        value = getattr(self, self.form)
        return f"{self.form}:" + json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)

    # -- per-form shape checks (the engine's compiler does the rest) -----------
    def _check_json(self) -> None:
        self.json = _json_value(self.json, "json")
        if not isinstance(self.json, (dict, bool)):
            raise _form_error("json", f"must be a JSON Schema object, got {type(self.json).__name__}")

    def _check_json_object(self) -> None:
        pass  # a bool; `is True` above already refused anything else

    def _check_regex(self) -> None:
        if not isinstance(self.regex, str) or not self.regex:
            raise _form_error("regex", f"must be a non-empty string, got {self.regex!r}")

    def _check_grammar(self) -> None:
        if not isinstance(self.grammar, str) or not self.grammar.strip():
            raise _form_error("grammar", f"must be a non-empty EBNF grammar string, got {self.grammar!r}")

    def _check_choice(self) -> None:
        choice = self.choice
        if isinstance(choice, tuple):
            choice = self.choice = list(choice)
        if not isinstance(choice, list) or not choice:
            raise _form_error("choice", f"must be a non-empty list of strings, got {choice!r}")
        bad = next((c for c in choice if not isinstance(c, str) or not c), None)
        if bad is not None or any(not isinstance(c, str) for c in choice):
            raise _form_error("choice", f"every choice must be a non-empty string, got {bad!r}")
        if len(set(choice)) != len(choice):
            dup = next(c for c in choice if choice.count(c) > 1)
            raise _form_error("choice", f"the choices must be distinct, {dup!r} is given twice")

    def _check_structural_tag(self) -> None:
        tag = self.structural_tag = _json_value(self.structural_tag, "structural_tag")
        if not isinstance(tag, dict) or tag.get("type", "structural_tag") != "structural_tag":
            raise _form_error("structural_tag", 'must be an object with "type": "structural_tag"')
        if "format" in tag:
            if not isinstance(tag["format"], dict):
                raise _form_error("structural_tag", '"format" must be an object')
        elif not (isinstance(tag.get("structures"), list) and isinstance(tag.get("triggers"), list)):
            raise _form_error("structural_tag", 'needs "format" (an object), or "structures" and "triggers" (lists)')


def _json_value(value: Any, form: str) -> Any:
    """A value given as JSON text, parsed; anything else as it is."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise _form_error(form, f"not valid JSON: {e}") from None


def _form_error(form: str, why: str) -> InvalidRequestError:
    return InvalidRequestError(f"structured_outputs.{form} is invalid: {why}", param=f"structured_outputs.{form}")


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
    # token id -> bias added to its logit, in [-100, 100] (OpenAI; string keys, as JSON sends them, become ints)
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None  # only these tokens may be sampled (vLLM)
    # never generate these words (vLLM): each is tokenized with and without a leading space, and
    # a word's last token is banned when the output ends with the word's earlier tokens
    bad_words: list[str] | None = None
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
        self._normalize_token_controls()

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

    def _normalize_token_controls(self) -> None:
        if self.logit_bias is not None:
            self.logit_bias = _normalized_logit_bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            _check(isinstance(ids, (list, tuple)) and len(ids) > 0 and all(_is_token_id(t) for t in ids),
                   "allowed_token_ids", ids, "must be a non-empty list of token ids (integers >= 0)")
            self.allowed_token_ids = list(ids)
        if self.bad_words is not None:
            words = self.bad_words
            _check(isinstance(words, (list, tuple)) and all(isinstance(w, str) and w.strip() for w in words),
                   "bad_words", words, "must be a list of non-empty strings")
            self.bad_words = list(words)

    @property
    def has_token_controls(self) -> bool:
        """logit_bias, allowed_token_ids or bad_words change this request's logits."""
        return bool(self.logit_bias or self.allowed_token_ids or self.bad_words)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def clone(self) -> SamplingParams:
        import copy
        return copy.deepcopy(self)


def bad_words_token_ids(tokenizer, bad_words: list[str]) -> list[list[int]]:
    """Each bad word as token ids, as vLLM does: alone (at the start of the text) and after a
    space (inside it), the second only when the space changes the tokens."""
    out: list[list[int]] = []
    for word in bad_words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tokenizer.encode(text, add_special_tokens=False)
            if ids and ids not in out:
                out.append(ids)
    return out


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _normalized_logit_bias(logit_bias: Any) -> dict[int, float]:
    """{token id: bias} with int keys; OpenAI clients send the ids as decimal strings."""
    _check(isinstance(logit_bias, dict), "logit_bias", logit_bias, "must be an object of token id -> bias")
    out: dict[int, float] = {}
    for key, bias in logit_bias.items():
        token_id = int(key) if isinstance(key, str) and re.fullmatch(r"[0-9]+", key) else key
        _check(_is_token_id(token_id), "logit_bias", logit_bias,
               f"key {key!r} is not a token id (an integer >= 0, or its decimal string)")
        _check(isinstance(bias, (int, float)) and not isinstance(bias, bool) and math.isfinite(bias)
               and -100.0 <= bias <= 100.0, "logit_bias", logit_bias, f"the bias of {key!r} must be a number in [-100, 100]")
        _check(token_id not in out, "logit_bias", logit_bias, f"token id {token_id} is given twice")
        out[token_id] = float(bias)
    return out


def _check(ok: bool, name: str, value: Any, why: str) -> None:
    if not ok:
        raise InvalidRequestError(f"{name}={value!r} is invalid: {why}", param=name)
