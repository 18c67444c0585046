"""The output directory: shards written whole or not at all, and the ids they already hold.

    <output>/part-<16 hex>.jsonl | .parquet    one per written batch; the name is a hash of its ids
    <output>/.part-<...>.tmp                   a shard being written (local filesystems only)

A shard appears only once complete: on a local filesystem it is written to a temporary name and
renamed (atomic on POSIX); on an object store (s3://, gs://, ...) it is one PUT, which is atomic
there. So a job killed at any moment leaves whole shards and maybe temporary files, never a torn
row. The name depends only on the ids inside, so a batch that Ray Data re-runs after its first
write went through overwrites its own shard instead of adding a second copy of its rows.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

FORMATS = ("jsonl", "parquet")


def open_output(uri: str) -> tuple[fsspec.AbstractFileSystem, str]:
    fs, path = fsspec.core.url_to_fs(uri)
    return fs, path.rstrip("/")


def shard_name(ids: list[Any], fmt: str) -> str:
    digest = hashlib.sha256(json.dumps(ids, default=str).encode()).hexdigest()[:16]
    return f"part-{digest}.{fmt}"


def write_shard(uri: str, table: pa.Table, fmt: str) -> str:
    """Write one batch of output rows as one shard, atomically; return its name."""
    if fmt not in FORMATS:
        raise ValueError(f"output format {fmt!r} is invalid: must be one of {FORMATS}")
    name = shard_name(table.column("id").to_pylist(), fmt)
    data = _encode(table, fmt)
    fs, root = open_output(uri)
    fs.makedirs(root, exist_ok=True)
    final = f"{root}/{name}"
    if _is_local(fs):
        tmp = f"{root}/.{name}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    else:
        fs.pipe_file(final, data)  # one PUT: the object exists whole or not at all
    return name


def _encode(table: pa.Table, fmt: str) -> bytes:
    if fmt == "parquet":
        buf = io.BytesIO()
        pq.write_table(table, buf)
        return buf.getvalue()
    lines = (json.dumps(row, ensure_ascii=False, default=str) for row in table.to_pylist())
    return "".join(line + "\n" for line in lines).encode()


def list_shards(uri: str) -> list[str]:
    """Full paths of the complete shards in the output directory ([] if it does not exist)."""
    fs, root = open_output(uri)
    if not fs.exists(root):
        return []
    names = (p.rsplit("/", 1)[-1] for p in fs.ls(root, detail=False))
    return sorted(f"{root}/{n}" for n in names if n.startswith("part-") and n.rsplit(".", 1)[-1] in FORMATS)


def remove_temporaries(uri: str) -> int:
    """Drop what a killed job was half-way through writing; returns how many."""
    fs, root = open_output(uri)
    if not fs.exists(root):
        return 0
    stale = [p for p in fs.ls(root, detail=False) if p.rsplit("/", 1)[-1].startswith(".part-")]
    for p in stale:
        fs.rm(p)
    return len(stale)


def read_rows(uri: str, columns: list[str] | None = None) -> list[dict[str, Any]]:
    """Every row of every shard (for resume, tests and small jobs; large outputs: read them with
    ray.data.read_json / read_parquet)."""
    fs, _ = open_output(uri)
    rows: list[dict[str, Any]] = []
    for path in list_shards(uri):
        if path.endswith(".parquet"):
            with fs.open(path, "rb") as f:
                rows.extend(pq.read_table(f, columns=columns).to_pylist())
            continue
        with fs.open(path, "rt") as f:
            for line in f:
                row = json.loads(line)
                rows.append({c: row.get(c) for c in columns} if columns else row)
    return rows


def done_ids(uri: str) -> set[Any]:
    """The ids the output directory holds already: what a resumed job skips."""
    return {row["id"] for row in read_rows(uri, columns=["id"])}


def _is_local(fs: fsspec.AbstractFileSystem) -> bool:
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return protocol in ("file", "local")
