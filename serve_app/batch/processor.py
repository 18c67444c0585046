"""`build_processor(config, preprocess=None, postprocess=None)`: a ray.data.Dataset of input rows
in, a Dataset of output rows out (lazily: nothing runs until the result is consumed).

    import ray
    from serve_app.batch import BatchConfig, build_processor

    processor = build_processor(BatchConfig(model="models/tiny-llama", template="Summarise: {{ doc }}"),
                                postprocess=lambda row: {"summary": row["text"].strip()})
    out = processor(ray.data.read_json("docs.jsonl"))   # needs an `id` column, or id_column=...
    out.write_parquet("summaries/")

Each output row: id, prompt, text, num_prompt_tokens, num_generated_tokens, finish_reason
(+ valid and error with a response_format), + what postprocess returns.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import ray

from serve_app.batch.config import BatchConfig
from serve_app.batch.prompts import ID, check_columns
from serve_app.batch.stages import (NO_ID_COLUMN, EngineClient, EngineStage, RetryCounter, RowFn, postprocess_batch,
                                   preprocess_batch)
from serve_app.replica.placement import resolve_device

# Retries: an engine actor that dies (OOM-kill, a lost node) is restarted and its batches
# resubmitted by Ray (the engine actors' max_restarts=-1, max_task_retries=-1, as Ray Data's
# actor pools have), and a failed CPU task is retried by Ray; a Python exception in generation is
# retried inside the actor on a fresh engine (EngineStage). Either way the batch, not the job,
# runs again. The engine stage's re-runs are counted (RetryCounter: num_retries,
# num_actor_restarts); Ray's retries of the CPU stages (a worker process that died) are not.

# CPU stages (templates, chat templates, JSON checks) are light: a quarter CPU each lets them run
# beside engine actors that hold the node's CPUs. Differing from the engine client's (none) also
# keeps Ray Data from fusing preprocessing into the client actor, where it would stall its calls.
CPU_STAGE_CPUS = 0.25


class Processor:
    def __init__(self, config: BatchConfig, preprocess: RowFn | None = None, postprocess: RowFn | None = None):
        # The device is decided here, on the driver, from the cluster's resources.
        self.config = dataclasses.replace(config, device=resolve_device(config.device))
        self.preprocess = preprocess
        self.postprocess = postprocess
        self._retry_counter = None
        self._engines: list = []

    def __call__(self, ds: ray.data.Dataset) -> ray.data.Dataset:
        """The pipeline over `ds` (lazy). Its ids are id_column's, or its `id` column; preprocess
        takes them out batch by batch, and a missing column is a ValueError naming it, here when
        `ds` knows its schema already, else when the batch that lacks it runs."""
        schema = ds.schema(fetch_if_missing=False)  # fetching would run (and force-stop) a read of ds
        if schema is not None:
            config = self.config
            if config.id_column is None and ID not in schema.names:
                raise ValueError(NO_ID_COLUMN)
            if self.preprocess is None:
                check_columns(config, schema.names, "the input")
            elif config.id_column is not None:
                check_columns(_ids_only(config), schema.names, "the input")
        return self.stages(ds)

    def start_engines(self) -> None:
        """Start the engine actors (num_replicas) now, if they are not running: they import torch and
        load the model while the caller goes on (run_job reads and checks its input meanwhile).
        They run until `shutdown`, or until this processor and its pipelines are gone."""
        if self._engines:
            return
        if self._retry_counter is None:
            self._retry_counter = ray.remote(num_cpus=0)(RetryCounter).remote()
        engine = ray.remote(EngineStage).options(max_restarts=-1, max_task_retries=-1, **self._actor_resources())
        self._engines = [engine.remote(self.config, self._retry_counter) for _ in range(self.config.num_replicas)]

    @property
    def engines(self) -> list:
        """The engine actors' handles (EngineStage; empty before start_engines)."""
        return list(self._engines)

    def shutdown(self) -> None:
        """Stop the engine actors (what `stages` built cannot run after this)."""
        for engine in self._engines:
            ray.kill(engine, no_restart=True)
        self._engines = []

    def engine_resources(self) -> dict[str, float]:
        """What the engine actors hold, which Ray Data's budget for the other stages leaves out."""
        resources = self._actor_resources()
        return {"cpu": resources["num_cpus"] * self.config.num_replicas,
                "gpu": resources.get("num_gpus", 0) * self.config.num_replicas}

    def stages(self, ds: ray.data.Dataset) -> ray.data.Dataset:
        """The pipeline over a Dataset that has an `id` column and was checked already (run_job)."""
        config = self.config
        self.start_engines()
        # Blocks of batch_size rows: a map task emits its output block only when it ends, so one
        # input block of 100k rows would be one engine call sequence, one shard, and no progress
        # (nor anything kept by a kill) until it all finished.
        ds = ds.repartition(target_num_rows_per_block=config.batch_size)
        ds = ds.map_batches(preprocess_batch, batch_format="pyarrow", batch_size=config.batch_size,
                            num_cpus=CPU_STAGE_CPUS, fn_kwargs={"config": config, "preprocess": self.preprocess})
        # One light client actor hands each batch to an engine actor, up to concurrent_batches per engine.
        calls = len(self._engines) * config.concurrent_batches()
        ds = ds.map_batches(EngineClient, batch_format="pyarrow", batch_size=config.batch_size, num_cpus=0,
                            compute=ray.data.ActorPoolStrategy(size=1, max_concurrent_calls_per_actor=calls),
                            fn_constructor_kwargs={"engines": self._engines})
        return ds.map_batches(postprocess_batch, batch_format="pyarrow", batch_size=config.batch_size,
                              num_cpus=CPU_STAGE_CPUS, fn_kwargs={"config": config, "postprocess": self.postprocess})

    def _actor_resources(self) -> dict[str, Any]:
        if self.config.device == "cuda":
            return {"num_gpus": self.config.tensor_parallel_size, "num_cpus": 1}
        return {"num_cpus": 1}  # a reservation; the actor's torch uses config.cpu_threads threads

    @property
    def num_retries(self) -> int:
        """Batch attempts beyond each batch's first so far (in-actor retries and Ray's re-runs)."""
        return self.retry_counts()[0]

    @property
    def num_actor_restarts(self) -> int:
        """Engine actors Ray restarted after they died."""
        return self.retry_counts()[1]

    def retry_counts(self) -> tuple[int, int]:
        return (0, 0) if self._retry_counter is None else tuple(ray.get(self._retry_counter.get.remote()))


def build_processor(config: BatchConfig, preprocess: RowFn | None = None,
                    postprocess: RowFn | None = None) -> Processor:
    return Processor(config, preprocess, postprocess)


def _ids_only(config: BatchConfig) -> BatchConfig:
    """With a preprocess function, the template's variables may come from it: check only the id."""
    return dataclasses.replace(config, template=None, prompt_column=config.id_column)
