"""OpenAI request bodies as pydantic models (OpenAI's field names, vLLM's extras), and their SamplingParams.

Validation is strict JSON typing (`"16"` is not an int, `1` is not a bool) with OpenAI's
ranges, so a wrong field is a 400 naming it, before anything reaches the engine.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from engine.sampling_params import MAX_LOGPROBS, SamplingParams, StructuredOutputsParams


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


class JsonSchemaSpec(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)
    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None

    @model_validator(mode="after")
    def _check(self):
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.json_schema is None):
            raise ValueError("response_format of type json_schema needs json_schema.schema")
        return self


class _SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(strict=True, extra="ignore")

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
    user: str | None = None
    # vLLM's extras (sent by the openai client through `extra_body`)
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # JSON output (grammar-constrained, then checked by the Guardrails deployment); vLLM also
    # takes it on /v1/completions.
    response_format: ResponseFormat | None = None
    # Accepted for compatibility only when they ask for nothing we do not do.
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _check_stop(cls, v: Any) -> Any:
        if v is None or isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v)):
            if isinstance(v, list) and any(not s for s in v) or v == "":
                raise ValueError("stop strings must not be empty")
            return v
        raise ValueError("must be a string or a list of strings")

    @field_validator("stop_token_ids")
    @classmethod
    def _check_stop_token_ids(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and any(t < 0 for t in v):
            raise ValueError("token ids must be >= 0")
        return v

    @model_validator(mode="after")
    def _check_common(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is not supported (it must be unset or equal to n)")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def json_mode(self) -> bool:
        return self.response_format is not None and self.response_format.type != "text"

    def structured_outputs(self) -> StructuredOutputsParams | None:
        fmt = self.response_format
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        return StructuredOutputsParams(json=fmt.json_schema.json_schema)

    def _sampling_kwargs(self) -> dict[str, Any]:
        return dict(
            n=self.n, temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
            top_k=self.top_k, min_p=self.min_p, seed=self.seed, stop=self.stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, min_tokens=self.min_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens)


class CompletionRequest(_SamplingFields):
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
        if self.echo and self.json_mode:
            raise ValueError("echo together with a JSON response_format is not supported (the text would not be JSON)")
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
                              structured_outputs=self.structured_outputs(), **self._sampling_kwargs())


def _is_token_id(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _check_content(cls, v: Any) -> Any:
        if isinstance(v, list):
            for part in v:
                if not isinstance(part, dict) or part.get("type") != "text":
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise ValueError(f"content part of type {kind!r} is not supported (only 'text')")
        return v

    @model_validator(mode="after")
    def _content_required(self):
        if self.content is None and self.role != "assistant":
            raise ValueError(f"content is required for a {self.role!r} message")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[Any] | None = None
    tool_choice: Any = None

    @model_validator(mode="after")
    def _check_chat(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs to be true")
        if self.tools:
            raise ValueError("tools are not supported")
        if self.tool_choice not in (None, "none"):
            raise ValueError("tool_choice is not supported")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        return self

    def to_sampling_params(self) -> SamplingParams:
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return SamplingParams(max_tokens=self.max_completion_tokens or self.max_tokens, logprobs=logprobs,
                              structured_outputs=self.structured_outputs(), **self._sampling_kwargs())
