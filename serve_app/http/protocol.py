"""OpenAI request bodies as pydantic models (OpenAI's field names, vLLM's extras), and their SamplingParams.

Validation is strict JSON typing (`"16"` is not an int, `1` is not a bool) with OpenAI's
ranges, so a wrong field is a 400 naming it, before anything reaches the engine. Every field
OpenAI or vLLM define is honoured or refused by name; any other field is refused too
(protocol_base.py). The parts: structured output and token controls (protocol_structured.py),
chat messages and tools (protocol_chat.py).
"""
from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator, model_validator

from engine.entrypoints.prompts import check_chat_template_kwargs
from engine.errors import InvalidRequestError
from engine.sampling_params import MAX_LOGPROBS, SamplingParams
from serve_app.http.messages import OutputSpec, ToolsSpec
from serve_app.http.protocol_base import (
    CHAT_UNSUPPORTED,
    COMMON_UNSUPPORTED,
    COMPLETION_UNSUPPORTED,
    StrictModel,
    Unsupported,
    check_token_ids,
)
from serve_app.http.protocol_chat import (
    ChatMessage,
    ChatTool,
    NamedToolChoice,
    parse_tool_choice,
    required_calls_schema,
)
from serve_app.http.protocol_structured import (
    StructuredChoice,
    StructuredFields,
    structured_params,
)


class StreamOptions(StrictModel):
    UNSUPPORTED = {
        "continuous_usage_stats": Unsupported("usage comes in the last chunk only", (False,)),
        "include_obfuscation": Unsupported("stream chunks are not padded", (False,)),
    }
    include_usage: bool = False


class _SamplingFields(StructuredFields):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    UNSUPPORTED = COMMON_UNSUPPORTED

    model: str
    n: int = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0.0, le=2.0)  # None: 1.0, as OpenAI
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Identify the end user / the caller, for abuse monitoring and cache routing on OpenAI's side;
    # they change no output there, and none here.
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None  # the prefix cache finds shared prefixes by itself
    metadata: dict[str, str] | None = None  # tags of a stored completion; nothing is stored (store: false)
    # vLLM's extras (sent by the openai client through `extra_body`)
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    best_of: int | None = None  # only as n: no candidates beyond the ones returned
    # vLLM's: lower is scheduled first; other than 0 only with the app arg scheduling_policy=priority
    # (the engine refuses it otherwise: a 400 naming `priority`).
    priority: int = Field(0, ge=-(2**63), le=2**63 - 1)

    @field_validator("stop", mode="before")
    @classmethod
    def _check_stop(cls, v: Any) -> Any:
        if v is None or isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v)):
            if isinstance(v, list) and any(not s for s in v) or v == "":
                raise ValueError("stop strings must not be empty")
            return v
        raise ValueError("must be a string or a list of strings")

    _check_stop_token_ids = field_validator("stop_token_ids")(check_token_ids)

    @model_validator(mode="after")
    def _check_common(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is not supported (it must be unset or equal to n)")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def _sampling_kwargs(self, structured: StructuredChoice | None) -> dict[str, Any]:
        return dict(
            n=self.n, temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
            top_k=self.top_k, min_p=self.min_p, seed=self.seed, stop=self.stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, min_tokens=self.min_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            structured_outputs=structured.params if structured else None, **self.token_controls())


class CompletionRequest(_SamplingFields):
    UNSUPPORTED = COMPLETION_UNSUPPORTED

    prompt: Any  # str | list[str] | list[int] | list[list[int]], checked below with one clear message
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt(cls, v: Any) -> Any:
        if isinstance(v, str):
            return v
        if isinstance(v, list) and v:
            if all(isinstance(p, str) for p in v):
                return v
            if all(_is_token_id(t) for t in v):
                return v
            if all(isinstance(p, list) and all(_is_token_id(t) for t in p) for p in v):
                return v
        if isinstance(v, list) and not v:
            raise ValueError("must not be empty")
        raise ValueError("must be a string, a list of strings, a list of token ids or a list of lists of token ids")

    @model_validator(mode="after")
    def _check_completion(self):
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.echo and self._form_sources():
            raise ValueError("echo together with a structured output form is not supported "
                             "(the echoed prompt would not follow it)")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The prompt(s) as a list: each a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)

    def to_sampling_params(self) -> SamplingParams:
        # echo + logprobs: the echoed prompt tokens get logprobs too (OpenAI's legacy behaviour).
        prompt_logprobs = self.logprobs if self.echo else None
        return SamplingParams(max_tokens=self.max_tokens, logprobs=self.logprobs, prompt_logprobs=prompt_logprobs,
                              **self._sampling_kwargs(self.structured_choice()))


def _is_token_id(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


class ChatCompletionRequest(_SamplingFields):
    UNSUPPORTED = CHAT_UNSUPPORTED

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Any = None  # parse_tool_choice: "none" | "auto" | "required" | NamedToolChoice
    parallel_tool_calls: bool = True
    include_reasoning: bool = True  # vLLM: false leaves reasoning_content out of the reply

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _check_tool_choice(cls, v: Any) -> Any:
        return parse_tool_choice(v)

    @field_validator("chat_template_kwargs")
    @classmethod
    def _check_template_kwargs(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        try:
            check_chat_template_kwargs(v)
        except InvalidRequestError as e:
            raise ValueError(str(e).removeprefix("chat_template_kwargs.")) from None
        return v

    @model_validator(mode="after")
    def _check_chat(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs to be true")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        self._check_tools()
        return self

    def _check_tools(self) -> None:
        if not self.tools:
            self.tools = None
        names = [t.function.name for t in self.tools or ()]
        dup = next((i for i, name in enumerate(names) if name in names[:i]), None)
        if dup is not None:
            raise ValueError(f"tools.{dup}.function.name: {names[dup]!r} names two tools")
        choice = self.tool_choice
        if choice not in (None, "none") and self.tools is None:
            raise ValueError("tool_choice needs tools: there is no tool to call")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice: {choice.function.name!r} is not one of the tools ({', '.join(names)})")
        if self.tool_mode in ("named", "required") and super().structured_choice() is not None:
            raise ValueError("tool_choice: a forced tool call is the output's structured form; it does not go "
                             "with response_format, structured_outputs or guided_*")

    # -- what the request asks of the output ----------------------------------------------
    @property
    def tool_mode(self) -> str:
        """"none" | "auto" | "required" | "named"; no tool_choice means "auto" with tools (OpenAI)."""
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice):
            return "named"
        if choice is None:
            return "auto" if self.tools else "none"
        return choice

    @property
    def json_mode(self) -> bool:
        """The output has a contract the guardrail checks: a JSON form, or tool calls."""
        return super().json_mode or self.tool_mode != "none"

    @property
    def structured_source(self) -> str | None:
        mode = self.tool_mode
        if mode == "named":
            return f"tools.{self._named_tool()[0]}.function.parameters"
        if mode == "required":
            return "tools"
        return super().structured_source

    def structured_choice(self) -> StructuredChoice | None:
        """A forced call's grammar (protocol_chat.py), or the request's structured form."""
        mode = self.tool_mode
        if mode == "named":
            source = self.structured_source
            schema = self._named_tool()[1].function.schema
            return StructuredChoice(structured_params({"json": schema}, source), source)
        if mode == "required":
            schema = required_calls_schema(self.tools, self.parallel_tool_calls)
            return StructuredChoice(structured_params({"json": schema}, "tools"), "tools")
        return super().structured_choice()

    def _named_tool(self) -> tuple[int, ChatTool]:
        name = self.tool_choice.function.name
        return next((i, t) for i, t in enumerate(self.tools) if t.function.name == name)

    def output_spec(self, reasoning_parser: str | None, tool_call_parser: str | None) -> OutputSpec:
        """How the reply is read, given the server's parsers (app args); InvalidRequestError (a 400)
        for "auto" on a server without a tool-call parser."""
        mode = self.tool_mode
        param = super().structured_source or "response_format"  # the JSON contract's field (a forced call has none)
        if mode == "none":
            return OutputSpec(reasoning_parser, None, param)
        if mode == "auto" and tool_call_parser is None:
            raise InvalidRequestError(
                'tool_choice "auto" (the default with tools) needs a tool-call parser, and this server has none '
                '(app arg tool_call_parser); send tool_choice "required", a named function, or "none"',
                param="tool_choice")
        schemas = {t.function.name: t.function.schema for t in self.tools}
        named = self.tool_choice.function.name if mode == "named" else None
        tools = ToolsSpec(mode, schemas, named, tool_call_parser if mode == "auto" else None,
                          self.parallel_tool_calls)
        return OutputSpec(reasoning_parser, tools, param)

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.for_template() for m in self.messages]

    def template_tools(self) -> list[dict[str, Any]] | None:
        return [t.for_template() for t in self.tools] if self.tools else None

    def to_sampling_params(self) -> SamplingParams:
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return SamplingParams(max_tokens=self.max_completion_tokens or self.max_tokens, logprobs=logprobs,
                              **self._sampling_kwargs(self.structured_choice()))
