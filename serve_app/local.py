"""Local Ray clusters running the application, on a free loopback port.

For tests and benchmarks (`serve run deploy/config.yaml` is the way to serve for real):

    with local_server({"model": "models/tiny-llama", "device": "cpu"}) as url:
        ...  # OpenAI-compatible endpoint at url + "/v1"

The pieces, for a test suite that shares one cluster between several apps:

    with local_cluster(num_cpus=2) as cluster_url:
        with deployed_app(cluster_url, args, "first") as url:   # url = cluster_url + "/first"
            call_deployment("first", "EngineDeployment", "get_stats")
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from engine.executor.network_utils import free_port

# The environment Serve's processes read at start: serve_app/serve_env.py, as `rayllm serve` sets it.
from serve_app.serve_env import (CONTROL_LOOP_ENV, DRAINING_PERIOD_ENV, HIGH_THROUGHPUT_ENV,  # noqa: F401
                                 apply, haproxy_private_env)

if TYPE_CHECKING:  # importing Ray Serve reads its environment, which local_cluster sets first
    from ray.serve import Application

APP_NAME = "llm"
METRICS_REPORT_INTERVAL_MS = 500  # tests wait on /metrics: each wait is about two of these
RAY_METRICS_REPORT_INTERVAL_MS = 10_000  # Ray's own default: what `serve run` clusters have
_REPO_ROOT = str(Path(__file__).resolve().parents[1])
_CALLER = "serve_app.local.caller"


@contextlib.contextmanager
def local_cluster(num_cpus: int | None = None, high_throughput: bool = True,
                  metrics_report_interval_ms: int = METRICS_REPORT_INTERVAL_MS) -> Iterator[str]:
    """Start Ray + Serve in this process (no app yet); yield Serve's base URL; shut both down after.

    high_throughput=False: Serve's Python ProxyActor instead of HAProxy (HIGH_THROUGHPUT_ENV).
    metrics_report_interval_ms: how often Ray's agent publishes metrics. Tests want /metrics fresh
    (0.5 s); a benchmark wants the CPU of what users run (RAY_METRICS_REPORT_INTERVAL_MS: 1 s costs
    the agent ~3% of a core, docs/benchmarks.md).
    """
    import ray

    if ray.is_initialized():  # ray.init would quietly join it, and the shutdown below end it
        raise RuntimeError("Ray is already initialized in this process: deploy into that cluster "
                           "(deployed_app) or shut it down first")
    saved_env = dict(os.environ)
    # Inherited by the cluster this process starts; restored when it is shut down. A value already in
    # the environment wins, except that high_throughput=False forces Serve's Python proxy.
    haproxy_dir = tempfile.mkdtemp(prefix="haproxy-serve-")
    for name, value in haproxy_private_env(haproxy_dir).items():
        os.environ.setdefault(name, value)
    apply(os.environ, high_throughput)
    # Replicas import serve_app from this checkout even when the package is not installed: in the
    # environment rather than a runtime_env, so that the workers Ray starts ahead of time serve
    # too (serve_app/batch/cluster.py).
    path = os.pathsep.join(p for p in (_REPO_ROOT, os.environ.get("PYTHONPATH")) if p)
    os.environ.update({"PYTHONPATH": path, "TOKENIZERS_PARALLELISM": "false"})
    from ray import serve

    port = free_port()
    # Ray's agent publishes recorded metrics every metrics_report_interval_ms, so GET /metrics
    # (serve_app/http/cluster_metrics.py) is at most about twice that behind.
    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False,
             _system_config={"metrics_report_interval_ms": metrics_report_interval_ms})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield f"http://127.0.0.1:{port}"
    finally:
        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()
        os.environ.clear()
        os.environ.update(saved_env)
        shutil.rmtree(haproxy_dir, ignore_errors=True)


def deploy_app(app: dict[str, Any] | Application, name: str = APP_NAME, route_prefix: str = "/") -> None:
    """Run the app (its args for build_app, or an app built already) under `name` in this
    process's cluster; returns once it is up."""
    deploy_apps({name: (app, route_prefix)})


def deploy_apps(apps: dict[str, tuple[dict[str, Any] | Application, str]]) -> None:
    """Run several apps ({name: (app as deploy_app takes it, route prefix)}) at once: their replicas
    start side by side; returns once every one is up (RuntimeError naming the first that failed)."""
    from ray import serve

    from serve_app.app import build_app

    targets = [serve.RunTarget(build_app(app) if isinstance(app, dict) else app, name=name, route_prefix=prefix)
               for name, (app, prefix) in apps.items()]
    serve.run_many(targets, wait_for_applications_running=False)
    _wait_for_apps(lambda statuses: _all_running(statuses, list(apps)))


def delete_app(name: str = APP_NAME) -> None:
    """Delete the app and wait until its replicas are gone."""
    delete_apps([name])


def delete_apps(names: list[str]) -> None:
    """Delete the apps at once and wait until all their replicas are gone."""
    from ray import serve

    for name in names:
        serve.delete(name, _blocking=False)
    _wait_for_apps(lambda statuses: not any(name in statuses for name in names))


# Serve's own blocking run and delete poll once a second: every deploy and delete of a test waited
# half a second more on average. The controller answers a status call in milliseconds.
_POLL_S = 0.1


def _wait_for_apps(done, timeout_s: float = 600.0) -> None:
    """Poll Serve's application statuses ({name: ApplicationStatusOverview}) until done(them)."""
    from ray import serve

    deadline = time.monotonic() + timeout_s
    while not done(serve.status().applications):
        if time.monotonic() > deadline:
            raise TimeoutError(f"Serve's applications did not settle in {timeout_s:.0f} s: {serve.status().applications}")
        time.sleep(_POLL_S)


def _all_running(statuses, names: list[str]) -> bool:
    for name in names:
        status = statuses.get(name)
        state = str(getattr(status.status, "value", status.status)) if status is not None else "NOT_STARTED"
        if state == "DEPLOY_FAILED":
            raise RuntimeError(f"Deploying application {name} failed: {status.message}")
        if state != "RUNNING":
            return False
    return True


@contextlib.contextmanager
def deployed_app(cluster_url: str, app: dict[str, Any] | Application, name: str) -> Iterator[str]:
    """The app (as deploy_app takes it) under `name` at route prefix "/<name>" of a running
    local_cluster; yield its base URL; delete it after."""
    deploy_app(app, name, route_prefix=f"/{name}")
    try:
        yield f"{cluster_url}/{name}"
    finally:
        delete_app(name)


@contextlib.contextmanager
def local_server(args: dict[str, Any], num_cpus: int | None = None, high_throughput: bool = True,
                 metrics_report_interval_ms: int = METRICS_REPORT_INTERVAL_MS) -> Iterator[str]:
    """Start Ray + Serve + the app (APP_NAME at "/"); yield the base URL; shut everything down after."""
    with local_cluster(num_cpus, high_throughput, metrics_report_interval_ms) as url:
        deploy_app(args)
        yield url


class _Caller:
    """A Ray actor in the cluster that calls deployments through DeploymentHandles (call_deployment).

    The calls are made there, not in this process: a handle's router runs on an event loop of the
    process that uses it, and which loop (the caller's or a thread Ray keeps for the life of the
    process) depends on Serve's environment when this process imported it. In an actor of the
    cluster it is the same as in the replicas, and it ends with the cluster."""

    async def call(self, app: str, deployment: str, method: str, *args: Any) -> Any:
        from ray import serve

        return await getattr(serve.get_deployment_handle(deployment, app_name=app), method).remote(*args)


def call_deployment(app: str, deployment: str, method: str, *args: Any) -> Any:
    """Call one method of a deployment of a running app from synchronous code (one replica: benchmarks, tests)."""
    import ray

    # Detached: a named actor still ends with the last handle to it, and these handles are short-lived.
    # It goes with the local cluster all the same.
    caller = ray.remote(num_cpus=0)(_Caller).options(name=_CALLER, get_if_exists=True, lifetime="detached").remote()
    return ray.get(caller.call.remote(app, deployment, method, *args))


def engine_deployment(app: str = APP_NAME) -> str:
    """The deployment whose replicas run the engine: the EngineDeployment, or with colocate_ingress the Ingress."""
    from ray import serve

    return "EngineDeployment" if "EngineDeployment" in serve.status().applications[app].deployments \
        else "Ingress"


def reconfigure_ingress(app: str, user_config: dict[str, Any]) -> None:
    """Apply an Ingress user_config on the running replica (what Serve does on a user_config change)."""
    call_deployment(app, "Ingress", "reconfigure", user_config)


def reconfigure_engine(app: str, user_config: dict[str, Any]) -> None:
    """Apply an EngineDeployment user_config on its running replica (what a user_config change does)."""
    call_deployment(app, "EngineDeployment", "reconfigure", user_config)
