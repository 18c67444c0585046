"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the right status.

Everything the client sent wrong becomes a 4xx here; a 500 means our bug, never the client's input.
"""
from __future__ import annotations

import re
from typing import Any

from pydantic import ValidationError


class OpenAIError(Exception):
    """An error to send to the client as OpenAI's error body."""

    def __init__(self, status_code: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | int | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def __reduce__(self):  # crosses Ray process boundaries intact
        return (_rebuild, (self.status_code, self.message, self.type, self.param, self.code, self.headers))


def _rebuild(status_code, message, type, param, code, headers) -> OpenAIError:
    return OpenAIError(status_code, message, type=type, param=param, code=code, headers=headers)


# -- constructors for each case, so the status/type/code pairs live in one place -------------
def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


def unauthorized() -> OpenAIError:
    return OpenAIError(401, "Incorrect or missing API key. Send it as 'Authorization: Bearer <key>'.",
                       code="invalid_api_key")


def model_not_found(model: str) -> OpenAIError:
    return OpenAIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")


def route_not_found(path: str, status_code: int = 404) -> OpenAIError:
    if status_code == 405:
        return OpenAIError(405, f"Method not allowed for {path}.", code="method_not_allowed")
    return OpenAIError(404, f"Unknown route {path}.", code="not_found")


def body_too_large(limit: int) -> OpenAIError:
    return OpenAIError(413, f"Request body is larger than the limit of {limit} bytes.", code="request_too_large")


def overloaded(message: str, retry_after_s: int, status_code: int = 503) -> OpenAIError:
    kind = "rate_limit_exceeded" if status_code == 429 else "service_unavailable"
    return OpenAIError(status_code, message, type=kind, code=kind, headers={"Retry-After": str(retry_after_s)})


def internal_error(message: str = "Internal server error.") -> OpenAIError:
    return OpenAIError(500, message, type="server_error", code="internal_error")


# -- mapping other exceptions ---------------------------------------------------------
def from_validation_error(e: ValidationError) -> OpenAIError:
    """The first problem, with `param` naming the field (`messages.0.content`)."""
    errors = e.errors(include_url=False)
    err = errors[0]
    loc = [str(p) for p in err["loc"] if not _is_union_tag(p)]
    param = ".".join(loc) or None
    if err["type"] == "json_invalid":
        return bad_request(f"The request body is not valid JSON: {err['msg']}", code="invalid_json")
    msg = err["msg"].removeprefix("Value error, ")
    if param is None:  # a whole-model check: its message starts with the field it is about
        m = _FIELD_IN_MESSAGE.match(msg)
        param = m.group(1) if m else None
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    where = f"'{param}': " if param else ""
    return bad_request(f"Invalid value for {where}{msg}{more}", param=param)


def _is_union_tag(part: Any) -> bool:
    # pydantic adds the union member it tried to the location: `prompt.str`, `prompt.list[int]`
    return isinstance(part, str) and (part in ("str", "int", "float", "bool") or "[" in part
                                      or part.startswith("function-") or part.startswith("constrained-"))


_FIELD_IN_MESSAGE = re.compile(r"^([a-z_][a-z0-9_.]*)(?:=|:| )")


def from_value_error(e: ValueError) -> OpenAIError:
    """A `ValueError` from SamplingParams or the engine: its message names the field first."""
    message = str(e)
    m = _FIELD_IN_MESSAGE.match(message)
    param = m.group(1) if m and m.group(1) in _KNOWN_PARAMS else None
    if "out of vocabulary" in message and param is None:
        param = "prompt"
    if param is None and ("JSON Schema" in message or "structured_outputs" in message):
        param = "response_format"
    if "maximum context length" in message or "max_model_len" in message:
        param = param or "max_tokens"
    return bad_request(message, param=param)


_KNOWN_PARAMS = {
    "n", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "top_k",
    "min_p", "seed", "max_tokens", "min_tokens", "logprobs", "stop", "stop_token_ids", "prompt", "messages",
    "response_format", "structured_outputs.json", "structured_outputs",
}

