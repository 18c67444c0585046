"""The pipeline's stages, as Ray Data UDFs over pyarrow batches.

    preprocess   CPU tasks    user preprocess fn, prompt template / column, chat template, tokenize
    generate     GPU actors   EngineStage: one engine.LLM per actor, a batch of rows per call
    postprocess  CPU tasks    JSON validation (the guardrail's check_output), user postprocess fn

Rows carry `id`, then `prompt` and `prompt_token_ids` after preprocess; generation replaces the
token ids with `text`, `num_prompt_tokens`, `num_generated_tokens` and `finish_reason`.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

import pyarrow as pa

from serve_app.batch.config import BatchConfig
from serve_app.batch.prompts import build_prompts, load_tokenizer
from serve_app.guardrail_policy import GuardrailPolicy, check_output
from serve_app.placement import use_cpu_threads

logger = logging.getLogger(__name__)

RowFn = Callable[[dict[str, Any]], dict[str, Any]]
# Output columns whose type Arrow cannot guess from a batch where every value is null.
_TYPES = {"prompt": pa.string(), "text": pa.string(), "finish_reason": pa.string(), "error": pa.string(),
          "valid": pa.bool_(), "num_prompt_tokens": pa.int64(), "num_generated_tokens": pa.int64()}


def to_table(rows: list[dict[str, Any]]) -> pa.Table:
    table = pa.Table.from_pylist(rows)
    for name, type_ in _TYPES.items():
        i = table.schema.get_field_index(name)
        if i >= 0 and table.schema.field(i).type != type_:
            table = table.set_column(i, name, table.column(i).cast(type_))
    return table


def preprocess_batch(batch: pa.Table, config: BatchConfig, preprocess: RowFn | None) -> pa.Table:
    rows = batch.to_pylist()
    if preprocess is not None:
        rows = [_checked(preprocess(dict(row)), "preprocess", row) for row in rows]
    return to_table(build_prompts(config, load_tokenizer(config.model), rows))


def postprocess_batch(batch: pa.Table, config: BatchConfig, postprocess: RowFn | None) -> pa.Table:
    rows = batch.to_pylist()
    structured = config.structured_outputs()
    if structured is not None:
        policy = GuardrailPolicy()
        for row in rows:
            schema = None if structured.json_object else structured.json
            result = check_output(row["text"], schema, structured.json_object, policy, row["finish_reason"])
            row["valid"] = result.passed
            row["error"] = None if result.passed else f"{result.reason}: {result.message}"
    if postprocess is not None:
        rows = [{**row, **_checked(postprocess(dict(row)), "postprocess", row)} for row in rows]
    return to_table(rows)


def _checked(out: Any, name: str, row: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(out, dict):
        raise TypeError(f"the {name} function must return a dict (the row), got {type(out).__name__} "
                        f"for row id={row.get('id')!r}")
    return out


class EngineStage:
    """One engine per actor; each call generates one batch of rows with it.

    A batch whose generation raises is retried up to `max_batch_retries` times on a fresh engine
    (the failure may have left the old one in any state), and counted in `retry_counter`. An actor
    that dies outright is restarted by Ray and its batch resubmitted (the actor's max_restarts /
    max_task_retries, set by the processor).
    """

    def __init__(self, config: BatchConfig, retry_counter=None):
        self.config = config
        self.retry_counter = retry_counter
        if config.device == "cpu":  # Ray's OMP_NUM_THREADS = num_cpus (1) would make it single-threaded
            use_cpu_threads(config.cpu_threads, config.tensor_parallel_size)
        self.llm = self._new_llm()

    def _new_llm(self):
        from engine import LLM
        return LLM(self.config.model, **self.config.llm_kwargs())

    def __call__(self, batch: pa.Table) -> pa.Table:
        rows = batch.to_pylist()
        prompts = [{"prompt": r["prompt"], "prompt_token_ids": r.pop("prompt_token_ids")} for r in rows]
        params = [self.config.sampling_params(r["id"]) for r in rows]
        outputs = self._generate(prompts, params)
        for row, out in zip(rows, outputs):
            completion = out.outputs[0]
            row.update(text=completion.text, num_prompt_tokens=len(out.prompt_token_ids),
                       num_generated_tokens=len(completion.token_ids), finish_reason=completion.finish_reason)
        return to_table(rows)

    def _generate(self, prompts, params):
        for attempt in range(self.config.max_batch_retries + 1):
            try:
                return self.llm.generate(prompts, params, use_tqdm=False)
            except Exception:
                if attempt == self.config.max_batch_retries:
                    raise
                logger.exception("batch of %d rows failed (attempt %d); retrying on a fresh engine",
                                 len(prompts), attempt + 1)
                if self.retry_counter is not None:
                    self.retry_counter.add.remote(1)
                self.llm.llm_engine.shutdown()
                self.llm = self._new_llm()
        raise AssertionError("unreachable")


class RetryCounter:
    """How many batches were retried, across all engine actors (a Ray actor, made by the processor)."""

    def __init__(self):
        self.count = 0

    def add(self, n: int) -> None:
        self.count += n

    def get(self) -> int:
        return self.count
