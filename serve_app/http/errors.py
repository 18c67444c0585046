"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the right status.

Everything the client sent wrong becomes a 4xx here; a 500 means our bug, never the client's input.
Engine failures are mapped by type, never by their wording: exception type -> ErrorKind
(EXCEPTION_KINDS, in the engine replica), carried across deployments in a StreamError, then
ErrorKind -> status, type and code (ERROR_TABLE, in the Ingress).
"""
from __future__ import annotations

import re
from typing import Any

from pydantic import ValidationError

from engine.errors import EngineDeadError, InvalidRequestError
from serve_app.http.messages import ErrorKind, StreamError
from serve_app.http.protocol_base import UNSUPPORTED_FIELD


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
    """vLLM's answer to a `model` that is neither the base model nor an adapter."""
    return OpenAIError(404, f"The model `{model}` does not exist.", type="NotFoundError", param="model", code=404)


def adapter_not_found(name: str) -> OpenAIError:
    """vLLM's answer to unloading an adapter it does not have."""
    return OpenAIError(404, f"The lora adapter '{name}' cannot be found.", type="NotFoundError",
                       param="lora_name", code=404)


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
    if err["type"] == "extra_forbidden":  # a field neither OpenAI nor vLLM defines (OpenAI's wording)
        return bad_request(f"Unrecognized request argument supplied: {param}", param=param)
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == UNSUPPORTED_FIELD:  # a field OpenAI or vLLM defines that this server does not do
        param = ".".join([*loc, err["ctx"]["field"]])
        return bad_request(f"'{param}' is not supported: {err['ctx']['why']}", param=param)
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


# -- engine failures: by type, in one table ------------------------------------------
# What the client is told for each kind: (HTTP status, OpenAI error type, code when the error has none).
# A 503 carries Retry-After, as the Ingress's own load shedding (overloaded()) does.
ERROR_TABLE: dict[ErrorKind, tuple[int, str, str | None]] = {
    ErrorKind.INVALID_REQUEST: (400, "invalid_request_error", None),
    ErrorKind.GUARDRAIL_VIOLATION: (422, "guardrail_violation", None),
    ErrorKind.OVERLOADED: (503, "service_unavailable", "service_unavailable"),
    ErrorKind.UNAVAILABLE: (503, "service_unavailable", "service_unavailable"),
    ErrorKind.INTERNAL: (500, "server_error", "internal_error"),
}

# Which kind an exception is: the first row it is an instance of (subclasses above their bases).
EXCEPTION_KINDS: tuple[tuple[type[BaseException], ErrorKind], ...] = (
    (EngineDeadError, ErrorKind.UNAVAILABLE),          # and WorkerDiedError: a dead TP worker
    (InvalidRequestError, ErrorKind.INVALID_REQUEST),  # and PromptTooLongError (code context_length_exceeded)
    (ValueError, ErrorKind.INVALID_REQUEST),           # untyped: param from the message's leading field name
)

# The engine's field names where the OpenAI API names the field otherwise.
_OPENAI_PARAMS = {"structured_outputs": "response_format", "structured_outputs.json": "response_format"}


def stream_error(e: BaseException) -> StreamError:
    """What the client should be told about `e`, as the StreamError that carries it to the Ingress.

    An internal error's message is generic: the exception's text is for the logs, not the client."""
    kind = next((k for t, k in EXCEPTION_KINDS if isinstance(e, t)), ErrorKind.INTERNAL)
    if kind is ErrorKind.INTERNAL:
        return StreamError(kind, "The engine failed while serving this request.")
    if kind is ErrorKind.UNAVAILABLE:
        return StreamError(kind, f"The engine is unavailable: {e}")
    if isinstance(e, InvalidRequestError):
        return StreamError(kind, str(e), param=_OPENAI_PARAMS.get(e.param, e.param), code=e.code)
    return StreamError(kind, str(e))


def from_stream_error(err: StreamError, retry_after_s: int) -> OpenAIError:
    """The OpenAI error for a failed stream, by ERROR_TABLE."""
    status, type_, code = ERROR_TABLE[err.kind]
    param = err.param
    if param is None and err.kind is ErrorKind.INVALID_REQUEST:  # an untyped ValueError: its message may say
        m = _FIELD_IN_MESSAGE.match(err.message)
        param = m.group(1) if m and m.group(1) in _KNOWN_PARAMS else None
    headers = {"Retry-After": str(retry_after_s)} if status == 503 else None
    return OpenAIError(status, err.message, type=type_, param=param, code=err.code or code, headers=headers)


def name_source(err: OpenAIError, source: str | None) -> OpenAIError:
    """An error about the request's structured-output constraint names the field the client sent it
    in (`source`: "guided_regex", "tools", ...), not the engine's `structured_outputs`, nor the
    response_format that stream_error names it after."""
    param = err.param
    if source is None or param is None or param == source:
        return err
    if param == "response_format" or param == "structured_outputs" or param.startswith("structured_outputs."):
        if not (source == "structured_outputs" and param.startswith("structured_outputs")):
            err.param = source
    return err


def from_value_error(e: ValueError) -> OpenAIError:
    """A ValueError raised in this process (SamplingParams, request conversion): a 400."""
    return from_stream_error(stream_error(e), retry_after_s=0)


# Request fields an untyped ValueError's message may start with ("max_tokens=9 is ...").
_KNOWN_PARAMS = {
    "n", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "top_k",
    "min_p", "seed", "max_tokens", "min_tokens", "logprobs", "stop", "stop_token_ids", "prompt", "messages",
    "response_format",
}

