"""Connecting a batch job to Ray: `init_ray(address)`, as the CLI and the benchmark do it.

Workers must import serve_app from this checkout even when the package is not installed, so
they need its root on PYTHONPATH. On a cluster that exists already that travels as the job's
runtime_env. On a new local cluster it is put in this process's environment before the cluster
starts instead, which the raylet and every worker it starts inherit: with a runtime_env, the
workers Ray starts ahead of time (one per CPU, during ray.init) do not match the job and sit
idle, and the job's first task and Ray Data's first actors each wait for a new worker process
(1-2 s apiece on a small node, measured in docs/benchmarks.md, "Batch job: fixed costs cut").
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

_REPO_ROOT = str(Path(__file__).resolve().parents[2])
WORKER_ENV = {"TOKENIZERS_PARALLELISM": "false"}  # tokenizers' own threads, one set per worker: off


def worker_env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (_REPO_ROOT, os.environ.get("PYTHONPATH")) if p)
    return {"PYTHONPATH": path, **WORKER_ENV}


def init_ray(address: str = "local", **kwargs: Any) -> None:
    """ray.init for a batch job: `address` "local" starts a new cluster on this machine."""
    import ray

    env = worker_env()
    if address == "local":
        os.environ.update(env)  # inherited by the cluster started here (see the module docstring)
        ray.init(address=address, log_to_driver=False, include_dashboard=False, **kwargs)
    else:
        ray.init(address=address, log_to_driver=False, include_dashboard=False,
                 runtime_env={"env_vars": env}, **kwargs)
    ray.data.DataContext.get_current().enable_progress_bars = False  # run_job counts rows and tokens
