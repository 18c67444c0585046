"""What passes between the deployments (Ingress -> Guardrails -> EngineDeployment and back), and nothing else.

Everything here is pickled on every hop, so the stream items are deltas with no
repeated prompt: a 2k-token prompt is sent once (in the request), never per token.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from engine.lora.request import LoRARequest
from engine.sampling_params import SamplingParams

# One token's log-probabilities: (token_id, logprob, rank, decoded_token) for the sampled token
# first, then the top-k candidates (the sampled token is not repeated among them).
TokenLogprob = tuple[int, float, int, str]


@dataclass
class ToolsSpec:
    """A chat request's tools as the guardrail checks its calls: every call names one of `schemas`
    and its arguments validate against that schema, as the client gave it (the whole of it)."""

    choice: str                     # "auto" (a parser finds calls in the text) | "required" | "named"
    schemas: dict[str, Any]         # tool name -> its parameters JSON Schema
    named: str | None = None        # choice "named": the tool the output is the arguments of
    parser: str | None = None       # choice "auto": the tool-call parser (app arg tool_call_parser)
    parallel_tool_calls: bool = True


@dataclass
class OutputSpec:
    """How a chat completion's text is read: its reasoning, its tool calls, and which request field
    a violation of its contract names."""

    reasoning_parser: str | None = None  # app arg reasoning_parser: <think> text to reasoning_content
    tools: ToolsSpec | None = None       # the calls to find and check (tool_choice other than "none")
    param: str = "response_format"       # the request field the contract comes from (the 422's param)


@dataclass
class EngineRequest:
    """One prompt to generate from (a completions request with k prompts sends k of these)."""

    request_id: str                 # unique per engine request; the engine aborts by it
    prompt_token_ids: list[int]     # already tokenized / chat-templated by the Ingress batch
    sampling_params: SamplingParams # output_kind is set to DELTA by the engine deployment
    prompt: str | None = None       # prompt text, when the client sent text (for logs and echo)
    json_mode: bool = False         # the output has a contract to check: JSON or tool calls (routes through Guardrails)
    batch_id: str | None = None     # the Ingress micro-batch it came in: one engine replica per batch
    stream: bool = False            # the client streams: the guardrail passes tokens on as they come
    output: OutputSpec | None = None  # chat: how to read the text (reasoning, tool calls); the guard's contract
    session: str | None = None      # the client's session (X-Session-ID, prompt_cache_key, user): prefix router's key
    lora_request: LoRARequest | None = None  # the adapter it runs with (the Ingress's registry); None: base model
    priority: int = 0               # the request's scheduling priority (engine scheduling_policy="priority")

    @property
    def multiplexed_model_id(self) -> str:
        """Serve's model multiplexing key: replicas holding the adapter are preferred; "": none."""
        return adapter_model_id(self.lora_request) if self.lora_request is not None else ""


def adapter_model_id(lora: LoRARequest) -> str:
    """An adapter's multiplexed model id: its name and id, so that an adapter loaded again under the
    same name (a new id, maybe new weights) is a new model to every replica's cache and to routing."""
    return f"{lora.lora_name}@{lora.lora_int_id}"


@dataclass
class ToolCall:
    """A complete call, its arguments validated against the tool's schema."""

    id: str          # "call_..." (OpenAI's shape)
    name: str
    arguments: str   # JSON text of the arguments object


@dataclass
class Delta:
    """New output of one of the request's n completions since the previous item.

    From the engine only `text` is set: the model's text. Once the guardrail has read a chat
    completion's text (OutputSpec), `text` is the content alone, `reasoning` the reasoning, and
    `tool_calls` the calls (validated, each whole, on the delta that finishes the completion)."""

    index: int                                # which completion (0..n-1)
    text: str                                 # new text (may be "" when a token is still incomplete UTF-8)
    token_ids: list[int]                      # new token ids
    logprobs: list[list[TokenLogprob]] | None = None  # one entry per new token, when asked for
    finish_reason: str | None = None          # "stop" | "length" once this completion is done
    stop_reason: int | str | None = None      # the stop string or token id that ended it
    reasoning: str = ""                       # new reasoning text (read by the guardrail)
    tool_calls: list[ToolCall] | None = None  # calls (read and validated by the guardrail)
    parsed: bool = False                      # the guardrail has read the text: text is content only


@dataclass
class StreamItem:
    """One item of an engine stream: the deltas of one or more engine steps, merged."""

    deltas: list[Delta] = field(default_factory=list)
    num_prompt_tokens: int = 0    # set on every item (cheap), for usage
    num_cached_tokens: int = 0    # prompt tokens served from the prefix cache
    # With prompt_logprobs: one entry per prompt token from the second on (the first has no
    # context), on one item only (the first after the prompt was scored).
    prompt_logprobs: list[list[TokenLogprob]] | None = None
    finished: bool = False        # the last item of the request
    error: "StreamError | None" = None  # set on the last item when the request failed
    # (outcome, reason) of each guardrail validation of this request, on the last item (for /metrics)
    guardrail_outcomes: list[tuple[str, str]] | None = None


class ErrorKind(str, enum.Enum):
    """Why a stream failed: a closed set. serve_app/http/errors.py's ERROR_TABLE gives each its HTTP status."""

    INVALID_REQUEST = "invalid_request"          # 400: the request cannot be served as sent
    GUARDRAIL_VIOLATION = "guardrail_violation"  # 422: the JSON output failed the guardrail
    OVERLOADED = "overloaded"                    # 503 + Retry-After: every engine replica is at capacity
    UNAVAILABLE = "unavailable"                  # 503 + Retry-After: engine dead, shutting down or unreachable
    INTERNAL = "internal"                        # 500: our bug, never the client's input


@dataclass
class StreamError:
    """Why an engine stream ended without finishing: maps to an HTTP status in the Ingress.

    kind is one of ErrorKind ("invalid_request", "guardrail_violation", "overloaded",
    "unavailable", "internal"); given as a string it is converted, and an unknown one is a
    ValueError here rather than a 500 in the Ingress.
    """

    kind: ErrorKind  # compares equal to its string value
    message: str  # shown to the client as is; never contains prompt text
    param: str | None = None  # the request field it is about, when the message does not name it
    code: str | None = None   # the error body's code (a guardrail violation's reason)

    def __post_init__(self) -> None:
        try:
            self.kind = ErrorKind(self.kind)
        except ValueError:
            raise ValueError(f"StreamError kind={self.kind!r} is invalid: choose one of "
                             f"{[k.value for k in ErrorKind]}") from None
