"""Reading the input, numbering its rows, and checking every row before any engine starts."""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import pyarrow as pa
import ray

from serve_app.batch.config import BatchConfig
from serve_app.batch.prompts import ID, check_columns, load_tokenizer, render_prompt
from serve_app.batch.stages import RowFn

# File extension -> Ray Data reader. Anything pyarrow/fsspec reads works: local paths, s3://, gs://, ...
READERS = {"jsonl": "read_json", "json": "read_json", "csv": "read_csv", "parquet": "read_parquet"}


def input_format(path: str, fmt: str | None = None) -> str:
    fmt = fmt or path.rstrip("/").rsplit(".", 1)[-1].lower()
    if fmt not in READERS:
        raise ValueError(f"cannot tell the input format of {path!r}: name it *.jsonl, *.csv or *.parquet, "
                         f"or pass the format ({sorted(READERS)})")
    return fmt


def read_input(path: str, fmt: str | None = None) -> ray.data.Dataset:
    """A lazy Dataset of the input's rows; an unreadable path is a ValueError naming it."""
    reader = getattr(ray.data, READERS[input_format(path, fmt)])
    kwargs = {"lines": True} if reader is ray.data.read_json else {}
    try:
        ds = reader(path, **kwargs)
        ds.schema()  # reads the first block: a missing file or a malformed one fails here, named
    except Exception as e:  # noqa: BLE001 - FileNotFoundError, ArrowInvalid, ... wrapped by Ray
        raise ValueError(f"cannot read the input {path}: {_root_message(e)}") from None
    return ds


@contextlib.contextmanager
def _preserve_order():
    options = ray.data.DataContext.get_current().execution_options
    saved, options.preserve_order = options.preserve_order, True
    try:
        yield
    finally:
        options.preserve_order = saved


@ray.remote
def _num_rows(table: pa.Table) -> int:
    return table.num_rows


@ray.remote
def _add_ids(table: pa.Table, start: int) -> pa.Table:
    return table.append_column(ID, pa.array(range(start, start + table.num_rows), pa.int64()))


def with_position_ids(ds: ray.data.Dataset) -> ray.data.Dataset:
    """`ds` with an `id` column: each row's position in the input (0, 1, ...), the same on every run.

    Row positions need the rows in order and the size of each block before it, so the input is
    materialized (in Ray's object store, which spills to disk) in read order. Inputs with an id
    column of their own avoid this pass: use id_column.
    """
    if ID in ds.columns():
        raise ValueError("the input has an 'id' column: name it as the id column (--id-column id) to use it")
    with _preserve_order():
        refs = ds.materialize().to_arrow_refs()
    sizes = ray.get([_num_rows.remote(r) for r in refs])
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return ray.data.from_arrow_refs([_add_ids.remote(r, s) for r, s in zip(refs, starts)])


def with_ids(ds: ray.data.Dataset, id_column: str | None) -> ray.data.Dataset:
    """The input with its ids in the `id` column: id_column renamed, or row positions."""
    if id_column is None:
        return with_position_ids(ds)
    columns = ds.columns()
    if id_column not in columns:
        raise ValueError(f"the input has no id column {id_column!r} (its columns: {sorted(columns)})")
    if id_column == ID:
        return ds
    if ID in columns:
        ds = ds.drop_columns([ID])
    return ds.rename_columns({id_column: ID})


def _check_batch(batch: pa.Table, config: BatchConfig, preprocess: RowFn | None) -> pa.Table:
    """Per row: its id, and what is wrong with it (None if nothing)."""
    ids, errors = [], []
    for row in batch.to_pylist():
        ids.append(row.get(ID))
        try:
            if row.get(ID) is None:
                raise ValueError("a row has no id (null)")
            render_prompt(config, preprocess(dict(row)) if preprocess else row)
            errors.append(None)
        except Exception as e:  # noqa: BLE001 - reported with the row, to the driver
            errors.append(str(e) if isinstance(e, ValueError) else f"row id={row.get(ID)!r}: {type(e).__name__}: {e}")
    return pa.table({"id_repr": pa.array([repr(i) for i in ids], pa.string()), "error": pa.array(errors, pa.string())})


def check_input(ds: ray.data.Dataset, config: BatchConfig, preprocess: RowFn | None, source: str) -> int:
    """Every row renders, ids are present and unique, the chat template exists: else a ValueError
    naming the first problem. Runs before any engine starts; returns the number of rows."""
    _check_up_front(config, ds.columns(), preprocess, source)
    seen: set[str] = set()
    num_rows = 0
    try:
        checked = ds.map_batches(_check_batch, batch_format="pyarrow", fn_kwargs={"config": config,
                                                                                 "preprocess": preprocess})
        for batch in checked.iter_batches(batch_format="pyarrow", batch_size=None):
            for id_repr, error in zip(batch.column("id_repr").to_pylist(), batch.column("error").to_pylist()):
                if error is not None:
                    raise ValueError(f"{source}: {error}")
                if id_repr in seen:
                    raise ValueError(f"{source}: id {id_repr} appears more than once; ids must be unique")
                seen.add(id_repr)
                num_rows += 1
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - a malformed line further into the file, wrapped by Ray
        raise ValueError(f"cannot read {source}: {_root_message(e)}") from None
    return num_rows


def read_checked(path: str, fmt: str | None, config: BatchConfig, preprocess: RowFn | None
                 ) -> tuple[ray.data.Dataset, int]:
    """The input with its ids in the `id` column, every row checked (check_input's checks, the
    same errors): the Dataset and its number of rows.

    With row positions as ids, numbering and checking are one Ray task per block over the
    materialized input, not two more Dataset executions: on a small cluster each execution
    costs a second or more of scheduling, whatever the input's size. Positions are unique, so
    only an id column needs the uniqueness pass of check_input.
    """
    ds = read_input(path, fmt)
    if config.id_column is not None:
        ds = with_ids(ds, config.id_column)
        return ds, check_input(ds, dataclasses.replace(config, id_column=None), preprocess, path)
    if ID in ds.columns():
        raise ValueError("the input has an 'id' column: name it as the id column (--id-column id) to use it")
    _check_up_front(config, ds.columns(), preprocess, path)
    try:
        with _preserve_order():
            refs = ds.materialize().to_arrow_refs()
        sizes = ray.get([_num_rows.remote(r) for r in refs])
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        numbered = [_number_and_check.remote(r, s, config, preprocess) for r, s in zip(refs, starts)]
        errors = ray.get([error for _, error in numbered])
    except Exception as e:  # noqa: BLE001 - a malformed line further into the file, wrapped by Ray
        raise ValueError(f"cannot read {path}: {_root_message(e)}") from None
    first = next((error for error in errors if error is not None), None)
    if first is not None:
        raise ValueError(f"{path}: {first}")
    return ray.data.from_arrow_refs([table for table, _ in numbered]), sum(sizes)


@ray.remote(num_returns=2)
def _number_and_check(table: pa.Table, start: int, config: BatchConfig, preprocess: RowFn | None
                      ) -> tuple[pa.Table, str | None]:
    """One block numbered from `start`, and its first row problem (None: every row is fine)."""
    table = table.append_column(ID, pa.array(range(start, start + table.num_rows), pa.int64()))
    errors = _check_batch(table, config, preprocess).column("error")
    return table, next((error for error in errors.to_pylist() if error is not None), None)


def _check_up_front(config: BatchConfig, columns: list[str], preprocess: RowFn | None, source: str) -> None:
    """What needs no row: the columns the prompts are built from, the model's chat template."""
    if preprocess is None:
        check_columns(config, columns, source)
    if config.chat and getattr(load_tokenizer(config.model), "chat_template", None) is None:
        raise ValueError(f"--chat: the model {config.model} has no chat template")


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
