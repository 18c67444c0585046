"""The base of every request model: strict JSON types, no fields beyond the ones declared, and
the fields OpenAI or vLLM define that this server does not do, refused by name.

Three kinds of field, so a client is never silently ignored:

    honoured      declared on the model and acted on (or, like `user`, defined to change nothing)
    refused       defined by OpenAI or vLLM but not done here: listed in the model's UNSUPPORTED,
                  a 400 `"<field> is not supported: <why>"` unless null or a value that asks for
                  nothing (`use_beam_search: false`, `store: false`, ...)
    unknown       in neither API: a 400 naming it (OpenAI's behaviour); the app arg
                  `unknown_request_fields: ignore` drops them instead (`extra="ignore"` at validation)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

from pydantic import BaseModel, ConfigDict, model_validator
from pydantic_core import PydanticCustomError

UNSUPPORTED_FIELD = "unsupported_field"  # the pydantic error type of a refused field (errors.py names it)


@dataclass(frozen=True)
class Unsupported:
    """A field this server refuses, and why; `neutral` values ask for nothing and are accepted."""

    why: str
    neutral: tuple[Any, ...] = ()


class StrictModel(BaseModel):
    """strict=True: "16" is not an int, 1 is not a bool; extra="forbid": an unknown field is a 400."""

    model_config = ConfigDict(strict=True, extra="forbid")
    UNSUPPORTED: ClassVar[Mapping[str, Unsupported]] = {}

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not cls.UNSUPPORTED:
            return data
        data = dict(data)
        for name, rule in cls.UNSUPPORTED.items():
            if name not in data:
                continue
            value = data.pop(name)  # accepted: it asks for nothing, so it need not be declared
            if value is not None and not any(_same(value, n) for n in rule.neutral):
                raise PydanticCustomError(UNSUPPORTED_FIELD, "{field} is not supported: {why}",
                                          {"field": name, "why": rule.why})
        return data


def _same(value: Any, neutral: Any) -> bool:
    # JSON's true is not 1: compare types as well as values.
    return type(value) is type(neutral) and value == neutral or (
        isinstance(value, (int, float)) and not isinstance(value, bool)
        and isinstance(neutral, (int, float)) and not isinstance(neutral, bool) and value == neutral)


# -- the fields each route refuses (the tables every decision is in) -----------------------------
_NO_BEAM = Unsupported("the engine samples; it has no beam search", (False,))
COMMON_UNSUPPORTED: dict[str, Unsupported] = {
    # OpenAI
    "service_tier": Unsupported("this server has one service tier", ("auto", "default")),
    "store": Unsupported("this server stores no completions", (False,)),
    # vLLM
    "use_beam_search": _NO_BEAM,
    "length_penalty": Unsupported("it applies to beam search, which is not supported", (1.0,)),
    "spaces_between_special_tokens": Unsupported("special tokens are always decoded without added spaces", (True,)),
    "truncate_prompt_tokens": Unsupported("prompts are never truncated (a prompt too long is a 400)"),
    "truncation_side": Unsupported("prompts are never truncated (a prompt too long is a 400)"),
    "request_id": Unsupported("the server names each request itself"),
    "logits_processors": Unsupported("custom logits processors are not supported"),
    "return_tokens_as_token_ids": Unsupported("logprobs always carry the token text", (False,)),
    "return_token_ids": Unsupported("responses carry text, not token ids", (False,)),
    "logprob_token_ids": Unsupported("use logprobs / top_logprobs"),
    "cache_salt": Unsupported("the prefix cache has no per-request salt"),
    "kv_transfer_params": Unsupported("disaggregated serving is not supported"),
    "vllm_xargs": Unsupported("no custom extensions are installed"),
    "mm_processor_kwargs": Unsupported("multimodal input is not supported"),
    "guided_whitespace_pattern": Unsupported("grammars write no free whitespace"),
    "watermarking": Unsupported("watermarking is not supported", (False,)),
}

COMPLETION_UNSUPPORTED: dict[str, Unsupported] = {
    **COMMON_UNSUPPORTED,
    "prompt_embeds": Unsupported("prompts are text or token ids"),
    "prompt_logprobs": Unsupported("use echo with logprobs, which scores the prompt's tokens too"),
    "add_special_tokens": Unsupported("a text prompt is always encoded with the tokenizer's special tokens",
                                      (True,)),
}

CHAT_UNSUPPORTED: dict[str, Unsupported] = {
    **COMMON_UNSUPPORTED,
    # OpenAI
    "audio": Unsupported("audio output is not supported"),
    "modalities": Unsupported("the output is text", (["text"],)),
    "prediction": Unsupported("predicted outputs are not supported"),
    "web_search_options": Unsupported("web search is not supported"),
    "functions": Unsupported("the deprecated functions API is not supported; send tools"),
    "function_call": Unsupported("the deprecated function_call is not supported; send tool_choice"),
    "reasoning_effort": Unsupported("reasoning is the model's; turn it off with chat_template_kwargs, "
                                    "e.g. {\"enable_thinking\": false}, where its template reads that"),
    "verbosity": Unsupported("the model's verbosity is not adjustable", ("medium",)),
    "moderation": Unsupported("moderation is not supported"),
    "prompt_cache_retention": Unsupported("the prefix cache keeps blocks while memory allows", ("in_memory",)),
    "prompt_cache_options": Unsupported("the prefix cache is automatic"),
    # vLLM
    "echo": Unsupported("the reply never repeats the last message", (False,)),
    "add_special_tokens": Unsupported("the chat template writes the special tokens", (False,)),
    "documents": Unsupported("documents (RAG templates) are not supported"),
    "chat_template": Unsupported("the checkpoint's chat template renders every request"),
    "media_io_kwargs": Unsupported("multimodal input is not supported"),
    "prompt_logprobs": Unsupported("use /v1/completions with echo and logprobs"),
    "thinking_token_budget": Unsupported("reasoning length is bounded by max_tokens only"),
    "session_id": Unsupported("requests carry no session"),
}


def check_token_ids(v: list[int] | None) -> list[int] | None:
    """A field of token ids (stop_token_ids, allowed_token_ids): none negative; the vocabulary
    bound is the engine's, which knows it."""
    if v is not None and any(t < 0 for t in v):
        raise ValueError("token ids must be >= 0")
    return v
