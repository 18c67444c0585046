"""Reading the input, numbering its rows, and checking every row before any engine starts."""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
from typing import Any

import pyarrow as pa
import ray

from engine.entrypoints.prompts import has_chat_template
from serve_app.batch.config import BatchConfig
from serve_app.batch.prompts import ID, check_columns, load_tokenizer, render_prompt, row_lora
from serve_app.batch.stages import RowFn, ids_from_column

# File extension -> Ray Data reader. Anything pyarrow/fsspec reads works: local paths, s3://, gs://, ...
READERS = {"jsonl": "read_json", "json": "read_json", "csv": "read_csv", "parquet": "read_parquet"}


def input_format(path: str, fmt: str | None = None) -> str:
    fmt = fmt or path.rstrip("/").rsplit(".", 1)[-1].lower()
    if fmt not in READERS:
        raise ValueError(f"cannot tell the input format of {path!r}: name it *.jsonl, *.csv or *.parquet, "
                         f"or pass the format ({sorted(READERS)})")
    return fmt


def read_input(path: str, fmt: str | None = None) -> ray.data.MaterializedDataset:
    """The input's rows in input order, read once into Ray's object store (which spills to disk):
    an unreadable path, or a malformed line anywhere in it, is a ValueError naming it.

    Read in full rather than probed: Ray Data learns a lazy Dataset's schema by running limit(1)
    and then force-killing the read tasks still running, and a read task that is just finishing
    when it is killed crashes Ray 2.60's core worker, the driver with it (task_manager.cc: "Tried
    to complete task that was not pending"). After this, the columns are known without running
    anything, and the checks and the job read the object store, not the input again.
    """
    reader = getattr(ray.data, READERS[input_format(path, fmt)])
    kwargs = {"lines": True} if reader is ray.data.read_json else {}
    try:
        with _preserve_order():
            return reader(path, **kwargs).materialize()
    except Exception as e:  # noqa: BLE001 - FileNotFoundError, ArrowInvalid, ... wrapped by Ray
        raise ValueError(f"cannot read the input {path}: {_root_message(e)}") from None


@contextlib.contextmanager
def _preserve_order():
    options = ray.data.DataContext.get_current().execution_options
    saved, options.preserve_order = options.preserve_order, True
    try:
        yield
    finally:
        options.preserve_order = saved


def _columns(ds: ray.data.MaterializedDataset) -> list[str]:
    return ds.columns() or []  # None: an empty input, no block to hold a schema


@ray.remote
def _num_rows(table: pa.Table) -> int:
    return table.num_rows


def _block_starts(refs: list) -> tuple[list[int], int]:
    """Each block's first row position, and the number of rows."""
    sizes = ray.get([_num_rows.remote(r) for r in refs])
    return [0, *itertools.accumulate(sizes)][:-1], sum(sizes)


def _with_positions(table: pa.Table, start: int) -> pa.Table:
    """The block with an `id` column: its rows' positions in the input, from `start`."""
    return table.append_column(ID, pa.array(range(start, start + table.num_rows), pa.int64()))


_add_ids = ray.remote(_with_positions)


def with_position_ids(ds: ray.data.Dataset) -> ray.data.Dataset:
    """`ds` with an `id` column: each row's position in the input (0, 1, ...), the same on every run.

    Row positions need the rows in order and the size of each block before it, so the input is
    materialized (in Ray's object store, which spills to disk) in read order.
    """
    with _preserve_order():
        ds = ds.materialize()
    if ID in _columns(ds):
        raise ValueError("the input has an 'id' column: name it as the id column (id_column='id') to use it")
    refs = ds.to_arrow_refs()
    starts, _ = _block_starts(refs)
    return ray.data.from_arrow_refs([_add_ids.remote(r, s) for r, s in zip(refs, starts)])


def _check_batch(batch: pa.Table, config: BatchConfig, preprocess: RowFn | None) -> list[str | None]:
    """Per row of a batch with ids in the `id` column: what is wrong with it (None if nothing)."""
    errors = []
    for row in batch.to_pylist():
        try:
            if row.get(ID) is None:
                raise ValueError("a row has no id (null)")
            row = preprocess(dict(row)) if preprocess else row
            render_prompt(config, row)
            row_lora(config, row)
            errors.append(None)
        except Exception as e:  # noqa: BLE001 - reported with the row, to the driver
            errors.append(str(e) if isinstance(e, ValueError) else f"row id={row.get(ID)!r}: {type(e).__name__}: {e}")
    return errors


def read_checked(path: str, fmt: str | None, config: BatchConfig, preprocess: RowFn | None
                 ) -> tuple[ray.data.Dataset, int]:
    """The input with its ids in the `id` column (config.id_column's, or row positions), every
    row checked before any engine gets one: the Dataset and its number of rows. The first
    problem (a missing column, a row that does not render, a null or repeated id) is a
    ValueError naming it.

    Numbering and checking are one Ray task per block of the materialized input, not Dataset
    executions: on a small cluster each execution costs a second or more of scheduling, and one
    stopped early at the first bad row would force-kill its running tasks (read_input's reason).
    """
    ds = read_input(path, fmt)
    columns = _columns(ds)
    if config.id_column is None and ID in columns:
        raise ValueError("the input has an 'id' column: name it as the id column (--id-column id) to use it")
    _check_up_front(config, columns, preprocess, path)
    refs = ds.to_arrow_refs()
    if config.id_column is None:
        starts, num_rows = _block_starts(refs)
    else:
        starts, num_rows = [None] * len(refs), ds.count()
    row_config = dataclasses.replace(config, id_column=None)
    checked = [_number_and_check.remote(r, s, config.id_column, row_config, preprocess) for r, s in zip(refs, starts)]
    problems = ray.get([problem for _, problem, _ in checked])
    first = next((problem for problem in problems if problem is not None), None)
    if first is not None:
        raise ValueError(f"{path}: {first}")
    if config.id_column is not None:
        _check_unique(ray.get([ids for _, _, ids in checked]), path)
    return ray.data.from_arrow_refs([table for table, _, _ in checked]), num_rows


@ray.remote(num_returns=3)
def _number_and_check(table: pa.Table, start: int | None, id_column: str | None, config: BatchConfig,
                      preprocess: RowFn | None) -> tuple[pa.Table, str | None, list[str] | None]:
    """One block with its ids in the `id` column (id_column's, or positions from `start`), its
    first row problem (None: every row is fine) and, for an id column, the ids' reprs."""
    table = _with_positions(table, start) if id_column is None else ids_from_column(table, id_column)
    problem = next((error for error in _check_batch(table, config, preprocess) if error is not None), None)
    ids = None if id_column is None else [repr(i) for i in table.column(ID).to_pylist()]
    return table, problem, ids


def _check_unique(ids_per_block: list[list[str]], source: str) -> None:
    seen: set[str] = set()
    for ids in ids_per_block:
        for id_repr in ids:
            if id_repr in seen:
                raise ValueError(f"{source}: id {id_repr} appears more than once; ids must be unique")
            seen.add(id_repr)


def _check_up_front(config: BatchConfig, columns: list[str], preprocess: RowFn | None, source: str) -> None:
    """What needs no row: the columns the prompts are built from, the model's chat template."""
    if preprocess is None:
        check_columns(config, columns, source)
    if config.chat and not has_chat_template(load_tokenizer(config.model)):
        raise ValueError(f"--chat: the model {config.model} has no chat template")
    if config.loras:  # every adapter runs on this model, before any engine loads it
        from engine.config import ModelConfig
        from engine.loader.model_path import resolve_model_path
        from serve_app.lora.adapters import check_lora_modules

        model_config = ModelConfig.from_pretrained(resolve_model_path(config.model))
        check_lora_modules(config.loras, config.max_lora_rank(), model_config, "--lora")


def _root_message(e: BaseException) -> str:
    """The innermost cause's message: Ray wraps reader errors in several layers."""
    while e.__cause__ is not None or getattr(e, "cause", None) is not None:
        e = e.__cause__ or e.cause
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[-1] if text else ''}"


def filter_done(ds: ray.data.Dataset, done: set[Any]) -> ray.data.Dataset:
    """Drop the rows whose id the output already holds (a resumed job)."""
    if not done:
        return ds
    return ds.map_batches(_drop_done, batch_format="pyarrow", fn_kwargs={"done": done})


def _drop_done(batch: pa.Table, done: set[Any]) -> pa.Table:
    keep = [i not in done for i in batch.column(ID).to_pylist()]
    return batch.filter(pa.array(keep, pa.bool_()))
