"""The engine's exceptions, by what the caller should do about them (no torch: the HTTP tier maps them).

    ValueError
      InvalidRequestError     the request cannot be served as sent; `param` names the field
        PromptTooLongError    prompt + max_tokens does not fit max_model_len (or the whole KV cache)
    RuntimeError
      EngineDeadError         the engine cannot serve anything any more (loop died, shut down)
        WorkerDiedError       ... because a tensor-parallel worker process exited

Callers branch on the type, never on the message: serve_app/http/errors.py maps each to an HTTP
status in one table. `InvalidRequestError` stays a ValueError, so `except ValueError` still
catches every refusal of user input. `param` uses the engine's field names (`temperature`,
`prompt`, `structured_outputs`); the OpenAI tier translates them to its own.
"""
from __future__ import annotations

from typing import Any


class InvalidRequestError(ValueError):
    """A request the engine refuses as sent: a bad sampling parameter, prompt or schema."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param  # the request field at fault (a SamplingParams field, "prompt", ...)
        self.code = code    # a machine-readable reason, when there is one

    def __reduce__(self):  # pickled with param and code (Ray hands exceptions between processes)
        return (type(self), (str(self), self.param, self.code))


class PromptTooLongError(InvalidRequestError):
    """The prompt plus the tokens asked for exceed what one sequence may hold."""

    def __init__(self, message: str, param: str | None = "prompt", code: str | None = "context_length_exceeded"):
        super().__init__(message, param, code)


class EngineDeadError(RuntimeError):
    """The step loop has stopped; no request can be served by this engine any more."""


class WorkerDiedError(EngineDeadError):
    """A tensor-parallel worker process exited (or never came up); the engine cannot go on.

    An EngineDeadError: without all its ranks the engine can run no collective, so every
    request fails the same way as when the step loop itself dies."""


def check_int(name: str, value: Any, minimum: int = 1) -> None:
    """ValueError naming `name` unless `value` is an int (not a bool) >= minimum."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name}={value!r} is invalid: must be an integer >= {minimum}")
