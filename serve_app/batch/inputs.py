"""Reading the input, numbering its rows, and checking every row before any engine starts."""
from __future__ import annotations

import contextlib
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
    if preprocess is None:
        check_columns(config, ds.columns(), source)
    if config.chat and getattr(load_tokenizer(config.model), "chat_template", None) is None:
        raise ValueError(f"--chat: the model {config.model} has no chat template")
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
