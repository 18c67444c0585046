"""The pipeline's stages, as Ray Data UDFs over pyarrow batches.

    preprocess   CPU tasks    user preprocess fn, prompt template / column, chat template
    generate     GPU actors   EngineStage: one engine.AsyncLLM per actor, a batch of rows per call,
                             several calls (batches) in one engine at once; the processor starts
                             these actors itself and Ray Data reaches them through EngineClient
    postprocess  CPU tasks    output validation (JSON: the guardrail's check_output), user postprocess fn

Rows carry `id`, then `prompt` after preprocess; generation adds `text`, `num_prompt_tokens`,
`num_generated_tokens` and `finish_reason`. The engine tokenizes a plain prompt itself, as
`engine.LLM.generate(str)` does; a chat-templated one is tokenized in the engine actor by the
special-token rule of engine/entrypoints/prompts.py (none added: the template wrote them), as
`engine.LLM.chat` does.
"""
from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import re
from typing import Any, Callable

import pyarrow as pa

from engine.errors import InvalidRequestError
from engine.sampling_params import (
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)
from serve_app.batch.config import BatchConfig
from serve_app.batch.prompts import ID, build_prompts, load_tokenizer, row_lora, tokenize_prompts
from serve_app.guard.policy import GuardrailPolicy, check_output
from serve_app.replica.placement import use_cpu_threads

logger = logging.getLogger(__name__)

RowFn = Callable[[dict[str, Any]], dict[str, Any]]
ERROR_FINISH_REASON = "error"  # a row the engine refused, kept with continue_on_error (text: null)
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


NO_ID_COLUMN = ("the dataset has no 'id' column: set id_column=, or number the rows with "
                "serve_app.batch.with_position_ids(ds)")


def ids_from_column(table: pa.Table, id_column: str | None) -> pa.Table:
    """The table with its ids in the `id` column: id_column's (renamed; an `id` column it replaces is
    dropped), or the `id` column it has. Either missing is a ValueError naming it."""
    names = table.column_names
    if id_column is None:
        if ID not in names:
            raise ValueError(NO_ID_COLUMN)
        return table
    if id_column not in names:
        raise ValueError(f"the input has no id column {id_column!r} (its columns: {sorted(names)})")
    if id_column == ID:
        return table
    if ID in names:
        table = table.drop_columns([ID])
    return table.rename_columns([ID if name == id_column else name for name in table.column_names])


def preprocess_batch(batch: pa.Table, config: BatchConfig, preprocess: RowFn | None) -> pa.Table:
    rows = ids_from_column(batch, config.id_column).to_pylist()
    if preprocess is not None:
        rows = [_checked(preprocess(dict(row)), "preprocess", row) for row in rows]
    tokenizer = load_tokenizer(config.model) if config.chat else None  # the chat template's
    return to_table(build_prompts(config, tokenizer, rows))


def postprocess_batch(batch: pa.Table, config: BatchConfig, postprocess: RowFn | None) -> pa.Table:
    rows = batch.to_pylist()
    structured = config.structured_outputs()
    if structured is not None:
        policy = GuardrailPolicy()
        for row in rows:
            if row["finish_reason"] == ERROR_FINISH_REASON:  # no text to check; its error stays
                row["valid"] = False
                continue
            row["error"] = output_error(structured, row["text"], row["finish_reason"], policy)
            row["valid"] = row["error"] is None
    if postprocess is not None:
        rows = [{**row, **_checked(postprocess(dict(row)), "postprocess", row)} for row in rows]
    return to_table(rows)


def output_error(structured: StructuredOutputsParams, text: str, finish_reason: str,
                 policy: GuardrailPolicy) -> str | None:
    """Why a finished row's text breaks its response_format, or None. JSON is checked by the
    guardrail against the whole schema; a regex by re.fullmatch; a choice by membership; a grammar
    or structural tag has no checker but its own, so only a complete document passes ("stop": the
    grammar accepted it whole; "length": max_tokens cut it off)."""
    cut = " (max_tokens cut it off)" if finish_reason == "length" else ""
    if structured.form in ("json", "json_object"):
        schema = None if structured.json_object else structured.json
        result = check_output(text, schema, structured.json_object, policy, finish_reason)
        return None if result.passed else f"{result.reason}: {result.message}"
    if structured.form == "regex":
        return None if re.fullmatch(structured.regex, text) else f"regex: the output does not match the pattern{cut}"
    if structured.form == "choice":
        return None if text in structured.choice else f"choice: the output is none of the choices{cut}"
    return None if finish_reason == "stop" else f"{structured.form}: the document is incomplete{cut}"


def _checked(out: Any, name: str, row: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(out, dict):
        raise TypeError(f"the {name} function must return a dict (the row), got {type(out).__name__} "
                        f"for row id={row.get('id')!r}")
    return out


class EngineStage:
    """One engine.AsyncLLM per actor; each call generates one batch of rows with it.

    The call is a coroutine, and the processor lets `max_concurrent_batches` calls run in one
    actor at once: the next batch's requests wait in the engine's queue and join the running
    batch as its sequences finish, so the engine's batch stays full across batch boundaries
    (continuous batching), instead of draining at the end of every batch while Ray Data ships
    the next one in and the last one out. Outputs do not depend on the batch around a row:
    greedy is greedy, and a seeded row samples from its own generator (engine/worker/sampler.py).

    A batch whose generation raises is retried up to `max_batch_retries` times on a fresh engine
    (the failure may have left the old one in any state; batches that failed with the same
    engine share one replacement), and counted in `retry_counter`. An actor that dies outright
    is restarted by Ray and its batches resubmitted (the processor's actor options).
    """

    def __init__(self, config: BatchConfig, retry_counter=None):
        self.config = config
        self.retry_counter = retry_counter
        if retry_counter is not None and _restarted_actor():
            retry_counter.actor_restarted.remote()
        if config.device == "cpu":  # Ray's OMP_NUM_THREADS = num_cpus (1) would make it single-threaded
            use_cpu_threads(config.cpu_threads, config.tensor_parallel_size)
        self.llm = self._new_llm()
        self._replacing: asyncio.Lock | None = None  # made on the event loop the calls run on

    def __del__(self):
        # Ray Data drops the UDF when the pool shuts down: stop the engine's step thread (and TP
        # workers) before the interpreter goes, not while it is being torn down.
        llm = self.__dict__.get("llm")
        if llm is not None:
            llm.shutdown()

    def _new_llm(self):
        from engine import AsyncLLM
        llm = AsyncLLM(model=self.config.model, **self.config.llm_kwargs())
        llm.engine.stats_log.enabled = False  # per-step stats are for serving's metrics; nobody reads them here
        return llm

    async def __call__(self, batch: pa.Table) -> pa.Table:
        rows = batch.to_pylist()
        ids = [r["id"] for r in rows]
        prompts = self._prompts(rows)
        params = [_final_only(self.config.sampling_params(r["id"])) for r in rows]
        loras = [row_lora(self.config, r) for r in rows]  # checked up front (inputs.py): known names
        if self.retry_counter is not None:  # a batch seen before is one Ray re-ran (its actor died);
            # awaited, so that it is counted even if this actor dies the next moment
            await self.retry_counter.batch_started.remote(batch_key(ids))
        outputs = await self._generate(prompts, params, ids, loras)
        for row, out in zip(rows, outputs):
            if isinstance(out, RowError):  # continue_on_error: the row is kept, with why it has no text
                row.update(text=None, num_prompt_tokens=None, num_generated_tokens=None,
                           finish_reason=ERROR_FINISH_REASON, error=out.message)
                continue
            completion = out.outputs[0]
            row.update(text=completion.text, num_prompt_tokens=len(out.prompt_token_ids),
                       num_generated_tokens=len(completion.token_ids), finish_reason=completion.finish_reason)
            if self.config.continue_on_error:
                row["error"] = None  # every shard has the column, so Parquet shards share one schema
        return to_table(rows)

    async def generate_batch(self, batch: pa.Table) -> pa.Table:
        """`self(batch)`, as the engine actor's method that EngineClient calls."""
        return await self(batch)

    def _prompts(self, rows: list[dict[str, Any]]) -> list:
        """The engine's prompts: the text, which the engine tokenizes, or for chat the token ids."""
        if not self.config.chat:
            return [row["prompt"] for row in rows]
        token_ids = tokenize_prompts(self.config, self.llm.tokenizer, rows)  # an empty one raises, naming its row
        return [{"prompt": row["prompt"], "prompt_token_ids": ids} for row, ids in zip(rows, token_ids)]

    async def _generate(self, prompts, params, ids, loras) -> list:
        for attempt in range(self.config.max_batch_retries + 1):
            llm = self.llm
            try:
                async with asyncio.TaskGroup() as group:  # one request fails: the batch's others are aborted
                    tasks = [group.create_task(_final_output(llm, *args, self.config.continue_on_error))
                             for args in zip(prompts, params, ids, loras)]
                return [t.result() for t in tasks]
            except Exception as e:  # noqa: BLE001 - a TaskGroup raises an ExceptionGroup
                error = _first_error(e)
                # A row the engine refuses (empty, too long) is refused by any engine: not retried.
                if isinstance(error, InvalidRequestError) or attempt == self.config.max_batch_retries:
                    raise error from None
                logger.error("batch of %d rows failed (attempt %d); retrying on a fresh engine: %r",
                             len(prompts), attempt + 1, error)
                if self.retry_counter is not None:
                    self.retry_counter.add.remote(1)
                await self._replace(llm)
        raise AssertionError("unreachable")

    async def _replace(self, failed) -> None:
        """A fresh engine instead of `failed`, unless a batch that failed with it replaced it already."""
        if self._replacing is None:
            self._replacing = asyncio.Lock()
        async with self._replacing:
            if self.llm is failed:
                await asyncio.to_thread(failed.shutdown)
                self.llm = await asyncio.to_thread(self._new_llm)


class EngineClient:
    """The engine stage's Ray Data UDF: each batch goes to the engine actor with the fewest batches.

    The engine actors are plain Ray actors that the processor starts, so that a job can start them
    (torch import, model load: seconds) while it reads and checks its input: the actors of Ray
    Data's own pool start only when the pipeline runs, after the checks. This UDF holds no engine
    and imports nothing heavy, so its actor starts in a fraction of a second. (Not Ray Data tasks
    that wait on the engine actors: each holds a worker process; docs/benchmarks.md.)
    """

    def __init__(self, engines: list):
        self.engines = engines
        self.in_flight = [0] * len(engines)

    async def __call__(self, batch: pa.Table) -> pa.Table:
        i = min(range(len(self.engines)), key=self.in_flight.__getitem__)
        self.in_flight[i] += 1
        try:
            return await self.engines[i].generate_batch.remote(batch)
        finally:
            self.in_flight[i] -= 1


@dataclasses.dataclass
class RowError:
    """A row the engine refused (continue_on_error): what it said, naming the row."""
    message: str


async def _final_output(llm, prompt, params, row_id, lora=None, keep_refusals: bool = False):
    final = None
    try:
        async for out in llm.generate(prompt, params, lora_request=lora):
            final = out
    except InvalidRequestError as e:  # the same type, with the row's id in the message
        message = f"row id={row_id!r}: {e}"
        if keep_refusals:
            return RowError(message)
        raise type(e)(message, e.param, e.code) from None
    return final


def _final_only(params: SamplingParams) -> SamplingParams:
    params.output_kind = RequestOutputKind.FINAL_ONLY  # one output per row, when it finishes
    return params


def _first_error(e: BaseException) -> BaseException:
    while isinstance(e, BaseExceptionGroup):
        e = e.exceptions[0]
    return e


class RetryCounter:
    """Retries across all engine actors (a Ray actor, made by the processor).

    `count`: batch attempts beyond each batch's first, whatever made them: a retry inside an
    actor on a fresh engine (`add`), or Ray running a batch again after its actor died (seen
    as a batch key that started before). `actor_restarts`: engine actors Ray restarted.
    """

    def __init__(self):
        self.count = 0
        self.actor_restarts = 0
        self._started: set[str] = set()

    def add(self, n: int) -> None:
        self.count += n

    def batch_started(self, key: str) -> None:
        if key in self._started:
            self.count += 1
        self._started.add(key)

    def actor_restarted(self) -> None:
        self.actor_restarts += 1

    def get(self) -> tuple[int, int]:
        return self.count, self.actor_restarts


def batch_key(ids: list[Any]) -> str:
    return hashlib.sha256(json.dumps(ids, default=str).encode()).hexdigest()[:16]


def _restarted_actor() -> bool:
    """Whether this process is an engine actor that Ray restarted after it died."""
    import ray
    if not ray.is_initialized():
        return False
    context = ray.get_runtime_context()
    # A driver (Ray started in this process, an EngineStage built outside an actor) has no actor
    # id, and Ray asserts instead of answering False when asked whether it was reconstructed.
    return context.get_actor_id() is not None and context.was_current_actor_reconstructed
