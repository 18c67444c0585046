"""The guardrail's checks on a finished JSON completion: pure logic, no Ray.

The Guardrails deployment calls `check_output` on each completion of a JSON request
(`response_format` json_object or json_schema); on a violation it retries up to
`policy.max_retries` times, then raises `GuardrailError`. Checks, in order, each with the
`reason` code it reports (also the error's `code` and the metrics label):

    max_output_bytes  the UTF-8 text is longer than the policy allows (checked before parsing)
    invalid_json      the text is not one JSON document (e.g. cut off by max_tokens)
    max_depth         objects/arrays nest deeper than the policy allows
    not_an_object     json_object was asked for and the top level is not an object
    schema            the document fails the request's schema (Draft 2020-12, formats checked)

Then `redact_patterns` replace what they match inside string values (never keys) with
"[REDACTED]"; if that breaks the schema (e.g. a `format: email` field), it is a "schema"
violation too: the client only ever receives a document that was validated as sent.
"""
from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

import jsonschema

from engine.errors import check_int
from serve_app.http.errors import OpenAIError

REDACTED = "[REDACTED]"
REASONS = ("max_output_bytes", "invalid_json", "max_depth", "not_an_object", "schema",
           "unknown_tool", "parallel_tool_calls")  # the last two: tool calls (serve_app/guard/contract.py)
_MAX_DEPTH_LIMIT = 256  # well inside Python's recursion limit, which json.loads and jsonschema share


@dataclass(frozen=True)
class GuardrailPolicy:
    """The server's policy for JSON output, from the app args (deploy/config.yaml)."""

    max_output_bytes: int = 1 << 20   # 1 MiB of UTF-8 per completion
    max_depth: int = 32               # nesting of objects/arrays; a scalar has depth 0
    redact_patterns: tuple[str, ...] = ()  # Python regexes, matched inside string values
    max_retries: int = 2              # generations after the first one fails
    _compiled: tuple[re.Pattern, ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_int("max_output_bytes", self.max_output_bytes, minimum=1)
        check_int("max_depth", self.max_depth, minimum=1)
        if self.max_depth > _MAX_DEPTH_LIMIT:  # the parser, validator and redaction recurse
            raise ValueError(f"max_depth={self.max_depth} is invalid: must be <= {_MAX_DEPTH_LIMIT}")
        check_int("max_retries", self.max_retries, minimum=0)
        if self.redact_patterns is None:  # `redact_patterns: null` in YAML
            object.__setattr__(self, "redact_patterns", ())
        if isinstance(self.redact_patterns, str) or not all(isinstance(p, str) for p in self.redact_patterns):
            raise ValueError(f"redact_patterns={self.redact_patterns!r} is invalid: must be a list of regex strings")
        compiled = []
        for i, pattern in enumerate(self.redact_patterns):
            try:
                compiled.append(re.compile(pattern))
            except re.error as e:
                raise ValueError(f"redact_patterns[{i}]={pattern!r} is not a valid regex: {e}") from None
            if compiled[-1].search(""):  # would "redact" between every two characters
                raise ValueError(f"redact_patterns[{i}]={pattern!r} matches the empty string")
        # Frozen, so set the derived field directly; patterns are compiled once, here.
        object.__setattr__(self, "redact_patterns", tuple(self.redact_patterns))
        object.__setattr__(self, "_compiled", tuple(compiled))

    @classmethod
    def from_args(cls, args: Mapping[str, Any] | None) -> "GuardrailPolicy":
        """From the `guardrails:` mapping of the app args; unknown keys are refused (typos)."""
        args = dict(args or {})
        known = {"max_output_bytes", "max_depth", "redact_patterns", "max_retries"}
        unknown = sorted(set(args) - known)
        if unknown:
            raise ValueError(f"unknown guardrail setting(s) {unknown}; known: {sorted(known)}")
        return cls(**args)

    def redact(self, value: Any) -> Any:
        """A copy of a parsed document with every pattern match in string values replaced."""
        if isinstance(value, str):
            for pattern in self._compiled:
                value = pattern.sub(REDACTED, value)
            return value
        if isinstance(value, dict):
            return {key: self.redact(v) for key, v in value.items()}
        if isinstance(value, list):
            return [self.redact(v) for v in value]
        return value


@dataclass
class GuardrailResult:
    outcome: Literal["passed", "violation"]
    text: str | None = None       # what the client gets: the model's text, or the redacted document
    document: Any = None          # the parsed (and redacted) document when passed
    reason: str | None = None     # one of REASONS when a violation
    message: str | None = None    # what was violated, for people

    @property
    def passed(self) -> bool:
        return self.outcome == "passed"


def _violation(reason: str, message: str) -> GuardrailResult:
    return GuardrailResult("violation", reason=reason, message=message)


def check_output(text: str, schema: dict | bool | None, json_object: bool, policy: GuardrailPolicy,
                 finish_reason: str | None = None) -> GuardrailResult:
    """Check one finished completion against the request's contract and the server's policy.

    `finish_reason` ("stop" / "length"), when given, lets the message say that a document is
    incomplete because max_tokens cut it off.
    """
    size = len(text.encode("utf-8"))
    if size > policy.max_output_bytes:
        return _violation("max_output_bytes", f"the output is {size} bytes, more than "
                                              f"max_output_bytes={policy.max_output_bytes}")
    try:
        document = json.loads(text, parse_constant=_refuse_constant)
    except ValueError as e:  # JSONDecodeError, or a NaN/Infinity that Python would accept
        cut = " (max_tokens cut it off before the document was complete)" if finish_reason == "length" else ""
        return _violation("invalid_json", f"the output is not valid JSON{cut}: {e}")
    except RecursionError:  # deeper than the parser's stack: far past any sane max_depth
        return _violation("max_depth", f"the output nests deeper than max_depth={policy.max_depth}")
    depth = _depth(document)
    if depth > policy.max_depth:
        return _violation("max_depth", f"the output nests {depth} levels deep, more than max_depth={policy.max_depth}")
    if json_object and not isinstance(document, dict):
        return _violation("not_an_object", f"json_object asks for a JSON object, the output is a "
                                           f"{_json_type(document)}")
    if schema is not None and (error := _schema_error(schema, document)):
        return _violation("schema", error)
    redacted = policy.redact(document)
    if redacted == document:
        return GuardrailResult("passed", text=text, document=document)
    if schema is not None and (error := _schema_error(schema, redacted)):
        return _violation("schema", f"after redaction by redact_patterns, {error}")
    return GuardrailResult("passed", text=json.dumps(redacted, ensure_ascii=False, separators=(",", ":")),
                           document=redacted)


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a JSON value")  # Python's json reads it; JSON has no such value


def _depth(document: Any) -> int:
    """Nesting of containers: 0 for a scalar, 1 for {} or [], 2 for {"a": []}. Iterative, so a
    deep document cannot overflow the stack."""
    deepest, stack = 0, [(document, 1)]
    while stack:
        value, level = stack.pop()
        if isinstance(value, dict):
            children = value.values()
        elif isinstance(value, list):
            children = value
        else:
            continue
        deepest = max(deepest, level)
        stack.extend((child, level + 1) for child in children)
    return deepest


def _json_type(value: Any) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}
    return names.get(type(value), "number")


@functools.lru_cache(maxsize=256)
def _validator(schema_json: str) -> jsonschema.Draft202012Validator:
    cls = jsonschema.Draft202012Validator
    return cls(json.loads(schema_json), format_checker=cls.FORMAT_CHECKER)


def _schema_error(schema: dict | bool, document: Any) -> str | None:
    """The most relevant schema violation as 'at <JSON path>: <message> (<keyword>)', or None."""
    validator = _validator(json.dumps(schema, sort_keys=True))
    error = jsonschema.exceptions.best_match(validator.iter_errors(document))
    if error is None:
        return None
    return f"the output does not match the schema at {error.json_path}: {error.message} ('{error.validator}')"


class GuardrailError(OpenAIError):
    """A JSON request whose output still violated the contract after every retry.

    Status 422 (Unprocessable Entity), type "guardrail_violation", code = the reason
    (`REASONS`), param the request field whose contract it is ("response_format", "tools",
    "guided_json", ...). Why 422: the request itself was valid (a bad schema
    is refused with a 400 before generation), so a 400 would wrongly blame the client; a 500
    says "server bug" and makes the OpenAI SDKs retry on their own, multiplying generations we
    already retried. 422 says "understood, but no conforming output could be produced"; the
    `openai` client raises it at once as `UnprocessableEntityError`, with this body.
    """

    STATUS = 422
    TYPE = "guardrail_violation"

    def __init__(self, reason: str, message: str, attempts: int, param: str = "response_format"):
        text = f"The output violated the {param} after {attempts} attempt(s): {message}"
        super().__init__(self.STATUS, text, type=self.TYPE, param=param, code=reason)
        self.reason, self.detail, self.attempts = reason, message, attempts

    @classmethod
    def from_result(cls, result: GuardrailResult, attempts: int) -> "GuardrailError":
        if result.passed:
            raise ValueError("a passed GuardrailResult is not an error")
        return cls(result.reason, result.message, attempts)

    def __reduce__(self):  # crosses Ray process boundaries as itself
        return (GuardrailError, (self.reason, self.detail, self.attempts, self.param))
