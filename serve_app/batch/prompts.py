"""Rows to prompts: render the template (or take the prompt column), apply the chat template
(CPU stages); tokenize (the engine stage). Pure functions of (config, tokenizer, rows): tested without Ray.
The chat template, the special-token rule and the checks are engine.entrypoints.prompts', as for
engine.LLM.chat and the server.

Every problem with a row raises `ValueError` naming the row's id and what is wrong with it, so
a job can check all of its input before any engine starts.
"""
from __future__ import annotations

import functools
from typing import Any, Iterable

import jinja2
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine.entrypoints.prompts import check_not_empty, encode, has_chat_template, render_chats
from engine.entrypoints.prompts import load_tokenizer as _load_tokenizer
from engine.errors import InvalidRequestError
from engine.lora.request import LoRARequest
from serve_app.batch.config import BatchConfig

ID = "id"  # the output's id column, whatever the input's id column is called
# Columns the job writes. An input column of one of these names is kept as input_<name>.
OUTPUT_COLUMNS = ("prompt", "text", "num_prompt_tokens", "num_generated_tokens", "finish_reason", "valid", "error")


@functools.lru_cache(maxsize=8)
def compile_template(source: str) -> tuple[jinja2.Template, frozenset[str]]:
    """The template and the variables it reads from the row. Sandboxed: templates are data."""
    env = ImmutableSandboxedEnvironment(undefined=jinja2.StrictUndefined, keep_trailing_newline=False)
    try:
        variables = frozenset(jinja2.meta.find_undeclared_variables(env.parse(source)))
        return env.from_string(source), variables
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"the prompt template does not parse (line {e.lineno}): {e.message}") from None


def required_columns(config: BatchConfig) -> set[str]:
    """Input columns the prompts are built from (checked against the input's schema up front)."""
    cols = set(compile_template(config.template)[1]) if config.template is not None else {config.prompt_column}
    for column in (config.id_column, config.lora_column):
        if column is not None:
            cols.add(column)
    return cols


def check_columns(config: BatchConfig, columns: Iterable[str], source: str) -> None:
    """Missing columns, named, before reading a single row. Template variables that a user
    preprocess function adds are checked row by row instead (they are not in the input)."""
    missing = sorted(required_columns(config) - set(columns))
    if missing:
        raise ValueError(f"{source} has no column(s) {missing} (its columns: {sorted(columns)})")


def render_prompt(config: BatchConfig, row: dict[str, Any]) -> str:
    """The prompt text of one row (before the chat template)."""
    row_id = row.get(ID)
    if config.template is None:
        prompt = row.get(config.prompt_column)
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f"row id={row_id!r}: column {config.prompt_column!r} must be a non-empty string, "
                             f"got {prompt!r}")
        return prompt
    template, variables = compile_template(config.template)
    absent = sorted(v for v in variables if row.get(v) is None)
    if absent:
        raise ValueError(f"row id={row_id!r}: template variable(s) {absent} absent from the row")
    try:
        prompt = template.render(**row)
    except jinja2.TemplateError as e:
        raise ValueError(f"row id={row_id!r}: the prompt template cannot render it: {e}") from None
    if not prompt:
        raise ValueError(f"row id={row_id!r}: the prompt template renders an empty prompt")
    return prompt


def row_lora(config: BatchConfig, row: dict[str, Any]) -> LoRARequest | None:
    """The adapter the row's lora_column names (ids 1..N in --lora's order: the same in every engine
    actor); None for the base model (no column, null or ""). An unknown name raises, naming the row."""
    name = row.get(config.lora_column) if config.lora_column is not None else None
    if name is None or name == "":
        return None
    if not isinstance(name, str) or name not in config.loras:
        raise ValueError(f"row id={row.get(ID)!r}: column {config.lora_column!r} names adapter {name!r}, which is "
                         f"not among --lora {sorted(config.loras)}")
    return LoRARequest(name, list(config.loras).index(name) + 1, config.loras[name])


def to_chat(tokenizer, prompts: list[str], row_ids: list[Any]) -> list[str]:
    """Each prompt as one user message, rendered with the model's chat template; a row the
    template refuses raises, naming it."""
    if not has_chat_template(tokenizer):
        raise ValueError("--chat: the model has no chat template")
    conversations = [[{"role": "user", "content": p}] for p in prompts]
    texts = render_chats(tokenizer, conversations, add_generation_prompt=True)
    for row_id, text in zip(row_ids, texts):
        if isinstance(text, InvalidRequestError):
            raise ValueError(f"row id={row_id!r}: the chat template cannot render it: {text}")
    return texts


def build_prompts(config: BatchConfig, tokenizer, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows with `prompt` (the text the model sees) added. The tokenizer is needed for config.chat
    only (its chat template); the engine stage tokenizes (tokenize_prompts), so that the CPU
    stages' workers need not import transformers, which imports torch: that costs a worker more
    than tokenizing its batch does (docs/benchmarks.md)."""
    texts = [render_prompt(config, row) for row in rows]
    if config.chat:
        texts = to_chat(tokenizer, texts, [row.get(ID) for row in rows])
    return [{**_keep_inputs(row, text), "prompt": text} for row, text in zip(rows, texts)]


def tokenize_prompts(config: BatchConfig, tokenizer, rows: list[dict[str, Any]]) -> list[list[int]]:
    """Each row's `prompt` as token ids, in one call per batch, by the special-token rule that
    engine.LLM uses: a chat-rendered prompt without adding special tokens (the template wrote
    them), a plain one with them. An empty one raises, naming its row."""
    ids = encode(tokenizer, [row["prompt"] for row in rows], chat=config.chat)
    for row, token_ids in zip(rows, ids):
        try:
            check_not_empty(token_ids)
        except InvalidRequestError as e:
            raise InvalidRequestError(f"row id={row.get(ID)!r}: {e}", e.param, e.code) from None
    return ids


def _keep_inputs(row: dict[str, Any], prompt: str) -> dict[str, Any]:
    """The row with its columns that the output would overwrite renamed input_<name> (a document
    column called `text`, say); a `prompt` column equal to the prompt is simply the prompt."""
    clashes = [c for c in OUTPUT_COLUMNS if c in row and not (c == "prompt" and row[c] == prompt)]
    if not clashes:
        return row
    return {(f"input_{k}" if k in clashes else k): v for k, v in row.items()}


# One tokenizer per worker process and model: Ray reuses worker processes across tasks.
load_tokenizer = functools.lru_cache(maxsize=4)(_load_tokenizer)
