"""Prompts into token ids, one way for every entry point: the chat template, the special-token
rule, the checks a prompt passes before it reaches an engine, and loading the tokenizer.

    LLM.chat        engine/entrypoints/llm.py       conversations; a problem raises ValueError
    Ingress         serve_app/http/preprocess.py    a micro-batch of requests; a problem is that request's 400
    batch jobs      serve_app/batch/prompts.py      rows; a problem raises ValueError naming the row

The special-token rule: text the user wrote is encoded with the tokenizer's special tokens (its
BOS), as `LLM.generate(str)` encodes it; a rendered chat is encoded without, because its template
writes them itself (adding a BOS to a template that starts with one would double it).

Every problem is an `InvalidRequestError` (a ValueError) whose `param` names the request field;
each caller words it for its own users. Torch-free: the HTTP tier imports this module, and
transformers (whose AutoTokenizer imports torch whenever torch is installed) is imported inside
`load_tokenizer` only.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from jinja2 import TemplateError

from engine.errors import InvalidRequestError, PromptTooLongError
from engine.loader.model_path import resolve_model_path

Conversation = list[dict[str, Any]]  # [{"role": ..., "content": ...}, ...]

# What a chat template raises for a conversation it refuses: jinja's errors (the template's own
# raise_exception among them), transformers' ValueErrors (say, a final message it cannot
# continue) and TypeErrors (a content of the wrong type).
_TEMPLATE_ERRORS = (TemplateError, ValueError, TypeError)


@dataclass(frozen=True)
class ModelLimits:
    """What a prompt is checked against before it reaches an engine (the engine checks again)."""

    max_model_len: int
    vocab_size: int


def load_tokenizer(model: str):
    """The tokenizer of `model` (a checkpoint directory, a .gguf, or a hub id in the local cache),
    loaded as the engine loads it, so the ids made with it are the ones the engine would make."""
    # Imported here, not at the top: transformers' AutoTokenizer imports torch whenever torch is
    # installed (transformers 5: configuration_utils -> modeling_rope_utils). So importing this
    # module stays torch-free, and where torch is not installed (an HTTP-tier image) transformers
    # runs tokenizers-only.
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_path(model))


# apply_chat_template's own arguments: chat_template_kwargs may not set them (a client's
# {"tokenize": true} would turn the text into ids; "tools" has a field of its own), only variables
# the template reads (enable_thinking, ...).
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


# -- chat templates ---------------------------------------------------------------------
def has_chat_template(tokenizer, chat_template: str | None = None) -> bool:
    """Whether a chat can be rendered: with the tokenizer's template, or the one given."""
    return chat_template is not None or getattr(tokenizer, "chat_template", None) is not None


def check_chat_template_kwargs(kwargs: Mapping[str, Any] | None) -> None:
    """Refuse keys that are apply_chat_template's own arguments (RESERVED_TEMPLATE_KWARGS)."""
    for key in kwargs or ():
        if not isinstance(key, str) or key in RESERVED_TEMPLATE_KWARGS:
            raise InvalidRequestError(f"chat_template_kwargs.{key} cannot be set: it is an argument of the "
                                      "template call itself, not a template variable", param="chat_template_kwargs")


def render_chats(tokenizer, conversations: Sequence[Conversation], *, add_generation_prompt: bool = True,
                 continue_final_message: bool = False, chat_template: str | None = None,
                 tools: list[dict[str, Any]] | None = None,
                 chat_template_kwargs: Mapping[str, Any] | None = None) -> list[str | InvalidRequestError]:
    """Each conversation as the text the model sees, or the error saying why the template refused it.

    `tools` (OpenAI's function tools) and `chat_template_kwargs` (template variables such as
    `enable_thinking`) reach the template as transformers passes them. An assistant message's
    `tool_calls[].function.arguments` given as JSON text (OpenAI's form) is handed to the
    template as the object it encodes, which is what chat templates expect (they `tojson` it).

    One template call renders them all (the common case); only when it fails is each rendered
    alone, so a conversation the template refuses costs the others nothing. Without a template
    (`has_chat_template` is false) every result is the same error.
    """
    if not has_chat_template(tokenizer, chat_template):
        return [InvalidRequestError("the model has no chat template", param="messages")] * len(conversations)
    try:
        check_chat_template_kwargs(chat_template_kwargs)
    except InvalidRequestError as e:
        return [e] * len(conversations)
    flags = {**(chat_template_kwargs or {}), "add_generation_prompt": add_generation_prompt,
             "continue_final_message": continue_final_message, "chat_template": chat_template}
    if tools:
        flags["tools"] = tools
    prepared = [_template_messages(conversation) for conversation in conversations]
    good = [c for c in prepared if not isinstance(c, InvalidRequestError)]
    try:
        rendered = iter(_apply_template(tokenizer, good, flags) if good else ())
    except _TEMPLATE_ERRORS:
        rendered = (_render_one(tokenizer, conversation, flags) for conversation in good)
    return [c if isinstance(c, InvalidRequestError) else next(rendered) for c in prepared]


def _template_messages(conversation: Conversation) -> Conversation | InvalidRequestError:
    """The conversation with tool-call arguments as objects (a copy where any changed), or why not."""
    if not any(isinstance(m, dict) and m.get("tool_calls") for m in conversation):
        return conversation
    try:
        return [_with_argument_objects(m) if isinstance(m, dict) and m.get("tool_calls") else m
                for m in conversation]
    except InvalidRequestError as e:
        return e


def _with_argument_objects(message: dict[str, Any]) -> dict[str, Any]:
    calls = []
    for call in message["tool_calls"]:
        function = call.get("function") if isinstance(call, dict) else None
        arguments = function.get("arguments") if isinstance(function, dict) else None
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as e:
                raise InvalidRequestError(f"a tool call's function.arguments is not JSON: {e}",
                                          param="messages") from None
            call = {**call, "function": {**function, "arguments": arguments}}
        calls.append(call)
    return {**message, "tool_calls": calls}


def _render_one(tokenizer, conversation: Conversation, flags: dict[str, Any]) -> str | InvalidRequestError:
    try:
        return _apply_template(tokenizer, [conversation], flags)[0]
    except _TEMPLATE_ERRORS as e:
        error = InvalidRequestError(str(e), param="messages")
        error.__cause__ = e  # the template's own exception, for the logs
        return error


def _apply_template(tokenizer, conversations: list[Conversation], flags: dict[str, Any]) -> list[str]:
    out = tokenizer.apply_chat_template(conversations, tokenize=False, **flags)
    return [out] if isinstance(out, str) else list(out)


# -- token ids --------------------------------------------------------------------------
def add_special_tokens(chat: bool) -> bool:
    """The special-token rule: the tokenizer adds its special tokens to a plain prompt, never to a
    rendered chat (the template wrote them)."""
    return not chat


def encode(tokenizer, texts: Sequence[str], *, chat: bool) -> list[list[int]]:
    """The token ids of each text, in one tokenizer call (a fast tokenizer encodes a list in one
    Rust call, in parallel); `chat`: the texts are rendered chats (add_special_tokens)."""
    if not texts:
        return []
    return [list(ids) for ids in tokenizer(list(texts), add_special_tokens=add_special_tokens(chat))["input_ids"]]


# -- checks -----------------------------------------------------------------------------
def check_not_empty(token_ids: Sequence[int], param: str = "prompt") -> None:
    if not token_ids:
        raise InvalidRequestError("The prompt is empty (0 tokens).", param=param)


def check_prompt(token_ids: Sequence[int], max_tokens: int | None, limits: ModelLimits,
                 param: str = "prompt") -> None:
    """An empty prompt, a token id out of the vocabulary, or prompt + completion longer than the
    model: each an InvalidRequestError, worded as OpenAI's API words it (clients parse the last
    one). `param`: the request field the prompt came from ("prompt", or "messages" for a chat)."""
    check_not_empty(token_ids, param)
    bad = next((t for t in token_ids if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(f"Token id {bad} is out of vocabulary (vocab_size={limits.vocab_size}).",
                                  param=param)
    num_completion = max_tokens or 1
    asked = len(token_ids) + num_completion
    if asked > limits.max_model_len:
        # max_tokens is the field to change when the prompt alone fits
        at_fault = "max_tokens" if max_tokens and len(token_ids) < limits.max_model_len else param
        raise PromptTooLongError(
            f"This model's maximum context length is {limits.max_model_len} tokens. However, you requested "
            f"{asked} tokens ({len(token_ids)} in the {param}, {num_completion} in the completion). "
            f"Please reduce the length of the {param} or completion.", param=at_fault)
