"""Rows to prompts: render the template (or take the prompt column), apply the chat template
(CPU stages); tokenize (the engine stage). Pure functions of (config, tokenizer, rows): tested without Ray.

Every problem with a row raises `ValueError` naming the row's id and what is wrong with it, so
a job can check all of its input before any engine starts.
"""
from __future__ import annotations

import functools
from typing import Any, Iterable

import jinja2
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

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
    if config.id_column is not None:
        cols.add(config.id_column)
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


def to_chat(tokenizer, prompts: list[str]) -> list[str]:
    """Each prompt as one user message, rendered with the model's chat template."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("--chat: the model has no chat template")
    conversations = [[{"role": "user", "content": p}] for p in prompts]
    out = tokenizer.apply_chat_template(conversations, tokenize=False, add_generation_prompt=True)
    return [out] if isinstance(out, str) else list(out)


def build_prompts(config: BatchConfig, tokenizer, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows with `prompt` (the text the model sees) added. The tokenizer is needed for config.chat
    only (its chat template); the engine stage tokenizes (tokenize_prompts), so that the CPU
    stages' workers need not import transformers, which imports torch (5 s of CPU per worker
    process on the 2-core box, more than tokenizing 1024 prompts takes: 0.15 s)."""
    texts = [render_prompt(config, row) for row in rows]
    if config.chat:
        texts = to_chat(tokenizer, texts)
    return [{**_keep_inputs(row, text), "prompt": text} for row, text in zip(rows, texts)]


def tokenize_prompts(config: BatchConfig, tokenizer, rows: list[dict[str, Any]]) -> list[list[int]]:
    """Each row's `prompt` as token ids, in one call per batch, as engine.LLM tokenizes: a
    chat-rendered prompt holds its special tokens already, so it is encoded without adding any
    (as engine.LLM.chat does); a plain prompt gets them, as engine.LLM.generate(str) does."""
    texts = [row["prompt"] for row in rows]
    ids = tokenizer(texts, add_special_tokens=not config.chat)["input_ids"] if texts else []
    for row, token_ids in zip(rows, ids):
        if not token_ids:
            raise ValueError(f"row id={row.get(ID)!r}: the prompt is empty (0 tokens)")
    return [list(token_ids) for token_ids in ids]


def _keep_inputs(row: dict[str, Any], prompt: str) -> dict[str, Any]:
    """The row with its columns that the output would overwrite renamed input_<name> (a document
    column called `text`, say); a `prompt` column equal to the prompt is simply the prompt."""
    clashes = [c for c in OUTPUT_COLUMNS if c in row and not (c == "prompt" and row[c] == prompt)]
    if not clashes:
        return row
    return {(f"input_{k}" if k in clashes else k): v for k, v in row.items()}


@functools.lru_cache(maxsize=4)
def load_tokenizer(model: str):
    """One tokenizer per worker process and model (Ray reuses worker processes across tasks)."""
    from transformers import AutoTokenizer

    from engine.loader.model_path import resolve_model_path
    return AutoTokenizer.from_pretrained(resolve_model_path(model))
