"""`run_job`: input file(s) -> checked rows -> processor -> shards in the output directory.

    read -> ids -> check every row (fail fast) -> skip ids already written (resume)
         -> preprocess -> generate -> postprocess -> write shard (one per batch, atomic)

The driver drives the stream and shows a progress bar (rows/s, tokens/s); `JobSummary` is what
it prints at the end.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
import warnings
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import ray
from ray.data import ExecutionResources
from tqdm.auto import tqdm

from serve_app.batch import shards
from serve_app.batch.config import BatchConfig
from serve_app.batch.inputs import filter_done, read_checked
from serve_app.batch.processor import CPU_STAGE_CPUS, Processor
from serve_app.batch.stages import ERROR_FINISH_REASON, RowFn

logger = logging.getLogger(__name__)


@dataclass
class JobSummary:
    num_rows: int = 0                 # rows generated and written by this run
    num_skipped: int = 0              # rows the output held already (resume)
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_invalid: int = 0              # rows whose output failed the response_format (valid = false)
    num_failed: int = 0               # rows the engine refused, written with their error (continue_on_error)
    num_retries: int = 0              # engine-stage batch attempts beyond each batch's first: retried in
                                      # its actor on a fresh engine, or re-run by Ray after its actor died
    num_actor_restarts: int = 0       # engine actors Ray restarted after they died
    num_shards: int = 0               # shards written by this run
    check_s: float = 0.0              # reading, numbering and checking the input, before any engine
    first_shard_s: float = 0.0        # until the first shard was written (engine start-up included)
    first_shard_rows: int = 0         # rows in that shard
    wall_s: float = 0.0

    def __str__(self) -> str:
        rate = self.num_rows / self.wall_s if self.wall_s else 0.0
        tok_rate = self.num_generated_tokens / self.wall_s if self.wall_s else 0.0
        return (f"{self.num_rows} rows written ({self.num_skipped} already done), {self.num_prompt_tokens} prompt "
                f"+ {self.num_generated_tokens} generated tokens, {self.num_invalid} invalid JSON rows, "
                f"{self.num_failed} failed rows, "
                f"{self.num_retries} batch retries ({self.num_actor_restarts} engine actor restarts), "
                f"{self.num_shards} shards, {self.wall_s:.1f} s "
                f"({self.check_s:.1f} s reading and checking the input; {rate:.2f} rows/s, "
                f"{tok_rate:.1f} generated tokens/s)")


def _write_batch(batch: pa.Table, output: str, fmt: str) -> pa.Table:
    """Write one batch as a shard; return one row of counts for the driver's progress and summary."""
    name = shards.write_shard(output, batch, fmt)
    valid = batch.column("valid").to_pylist() if "valid" in batch.column_names else []
    failed = [reason == ERROR_FINISH_REASON for reason in batch.column("finish_reason").to_pylist()]
    return pa.table({"shard": [name], "num_rows": [batch.num_rows],
                     "num_prompt_tokens": [sum(n or 0 for n in batch.column("num_prompt_tokens").to_pylist())],
                     "num_generated_tokens": [sum(n or 0 for n in batch.column("num_generated_tokens").to_pylist())],
                     "num_invalid": [sum(1 for v, f in zip(valid, failed) if not v and not f)],
                     "num_failed": [sum(failed)]})


def run_job(config: BatchConfig, input_path: str, output: str, *, resume: bool = False,
            input_format: str | None = None, output_format: str = "jsonl", preprocess: RowFn | None = None,
            postprocess: RowFn | None = None, progress: bool = True) -> JobSummary:
    """Run a batch job in the current Ray cluster (ray.init() first). Bad input raises ValueError
    before any engine starts; an output directory holding shards needs resume=True."""
    if output_format not in shards.FORMATS:
        raise ValueError(f"output_format={output_format!r} is invalid: must be one of {shards.FORMATS}")
    start = time.monotonic()
    summary = JobSummary()
    existing = shards.list_shards(output)
    if existing and not resume:
        raise ValueError(f"the output directory {output} holds {len(existing)} shard(s) already: "
                         f"pass --resume to finish that job, or choose an empty directory")
    # The engine actors start loading the model now, while the input is read and checked; they
    # get no row before every row passed, and they are stopped however the job ends.
    processor = Processor(dataclasses.replace(config, id_column=None), preprocess, postprocess)
    processor.start_engines()
    try:
        ds, num_input = read_checked(input_path, input_format, config, preprocess)
        summary.check_s = time.monotonic() - start
        done: set[Any] = set()
        if resume:
            shards.remove_temporaries(output)
            done = shards.done_ids(output)
        summary.num_skipped = len(done)
        out = processor.stages(filter_done(ds, done))  # the ids are in the `id` column now, checked
        # A quarter CPU, as postprocess: Ray Data's default of a whole CPU per task left the write
        # tasks waiting for a CPU that the engine actor and the other stages held until the job's
        # end, so every shard was written (and progress reported) in the last second.
        written = out.map_batches(_write_batch, batch_format="pyarrow", batch_size=None, num_cpus=CPU_STAGE_CPUS,
                                  fn_kwargs={"output": output, "fmt": output_format})
        with _excluded(processor.engine_resources()):
            _drive(written, summary, total=num_input - len(done), start=start, progress=progress)
        summary.num_retries, summary.num_actor_restarts = processor.retry_counts()
    finally:
        processor.shutdown()
    summary.wall_s = time.monotonic() - start
    return summary


@contextlib.contextmanager
def _excluded(resources: dict[str, float]):
    """Ray Data's budget without what the engine actors hold: they are not in its pipeline.

    Ray 2.60 deprecates exclude_resources for label selectors, which cannot say "these CPUs are
    held by actors outside the pipeline"; resource_limits could, but would freeze the budget at
    the cluster's size now, which an autoscaling cluster outgrows.
    """
    options = ray.data.DataContext.get_current().execution_options
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        saved = options.exclude_resources
        options.exclude_resources = saved.add(ExecutionResources(**resources))
    try:
        yield
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            options.exclude_resources = saved


def _drive(written: ray.data.Dataset, summary: JobSummary, total: int, start: float, progress: bool) -> None:
    """Pull the pipeline through; count what each shard holds into the summary and the bar."""
    with tqdm(total=max(total, 0), unit="row", disable=not progress, desc="batch") as bar:
        if total <= 0:
            return
        for row in written.iter_rows():
            summary.num_rows += row["num_rows"]
            summary.num_prompt_tokens += row["num_prompt_tokens"]
            summary.num_generated_tokens += row["num_generated_tokens"]
            summary.num_invalid += row["num_invalid"]
            summary.num_failed += row["num_failed"]
            summary.num_shards += 1
            if summary.num_shards == 1:
                summary.first_shard_s, summary.first_shard_rows = time.monotonic() - start, row["num_rows"]
            bar.update(row["num_rows"])
            elapsed = time.monotonic() - start
            bar.set_postfix_str(f"{summary.num_generated_tokens / elapsed:.1f} tok/s, "
                                f"{summary.num_invalid} invalid, {summary.num_failed} failed", refresh=False)
