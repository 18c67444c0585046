"""Run the application in this process's own local Ray cluster, on a free loopback port.

For tests and benchmarks (`serve run deploy/config.yaml` is the way to serve for real):

    with local_server({"model": "models/tiny-llama", "device": "cpu"}) as url:
        ...  # OpenAI-compatible endpoint at url + "/v1"
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

from engine.executor.network_utils import free_port

APP_NAME = "llm"
# Ray Serve's high-throughput mode (Ray docs: "Enable High Throughput on Ray Serve"), which
# `make serve`, the Dockerfile and the RayService set too: HAProxy (C) takes the HTTP port in
# place of the Python ProxyActor and forwards to the Ingress replica's own HTTP server (direct
# ingress), and replicas talk gRPC. It cut the serving path's CPU per streamed token ~2x on
# the CPU box (docs/benchmarks.md, "Serving overhead"). Read by Ray's processes at start, so
# it is environment, not an app arg; a value already set in the environment wins ("0" = off).
HIGH_THROUGHPUT_ENV = {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"}
# Serve's controller reconciles every 0.1 s by default, and each pass costs CPU in it and in the
# replicas it polls: at 0.5 s the served CPU box streamed ~10% more tokens/s (4.95 -> 4.5 CPU ms
# per token, docs/benchmarks.md). Autoscaling and health checks work in seconds, so a 0.5 s
# reaction is enough. `make serve`, the Dockerfile and the RayService set it too; the
# environment wins.
CONTROL_LOOP_ENV = {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5"}
METRICS_REPORT_INTERVAL_MS = 1000
# A stopping direct-ingress replica stays reachable this long so that load balancers in front
# can deregister it; Ray's default, 30 s, made every test module's teardown wait 30 s for the
# Ingress. Here HAProxy on the same node is the only balancer, reloaded as the replica stops.
DRAINING_PERIOD_ENV = {"RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "1"}
RAY_METRICS_REPORT_INTERVAL_MS = 10_000  # Ray's own default: what `serve run` clusters have
_REPO_ROOT = str(Path(__file__).resolve().parents[1])


@contextlib.contextmanager
def local_server(args: dict[str, Any], num_cpus: int | None = None, high_throughput: bool = True,
                 metrics_report_interval_ms: int = METRICS_REPORT_INTERVAL_MS) -> Iterator[str]:
    """Start Ray + Serve + the app; yield the base URL; shut everything down after.

    high_throughput=False: Serve's Python ProxyActor instead of HAProxy (HIGH_THROUGHPUT_ENV).
    metrics_report_interval_ms: how often Ray's agent publishes metrics. Tests want /metrics fresh
    (1 s); a benchmark wants the CPU of what users run (RAY_METRICS_REPORT_INTERVAL_MS: at 1 s the
    agent used ~3% more of a core on the CPU box, docs/benchmarks.md).
    """
    saved_env = dict(os.environ)
    # Inherited by the cluster this process starts; restored when it is shut down. Set before
    # Ray Serve is imported here: the handles bound below take their protocol (gRPC or Ray
    # calls) from this process's environment at import (serve_app/app.py builds them here).
    mode = HIGH_THROUGHPUT_ENV if high_throughput else dict.fromkeys(HIGH_THROUGHPUT_ENV, "0")
    haproxy_dir = tempfile.mkdtemp(prefix="haproxy-serve-")
    os.environ.update({**_haproxy_private_env(haproxy_dir), **DRAINING_PERIOD_ENV, **CONTROL_LOOP_ENV, **os.environ,
                       **mode})
    import ray
    from ray import serve

    from serve_app.app import build_app

    port = free_port()
    # Replicas import serve_app from this checkout even when the package is not installed.
    path = os.pathsep.join(p for p in (_REPO_ROOT, os.environ.get("PYTHONPATH")) if p)
    # metrics_report_interval_ms: by default Ray's agent publishes recorded metrics every second (its
    # own default is 10 s), so GET /metrics (serve_app/http/cluster_metrics.py) is at most ~2 s behind.
    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True,
             _system_config={"metrics_report_interval_ms": metrics_report_interval_ms},
             runtime_env={"env_vars": {"PYTHONPATH": path, "TOKENIZERS_PARALLELISM": "false"}})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(args), name=APP_NAME, route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        with contextlib.suppress(Exception):
            serve.shutdown()
        stop_router_loop()
        ray.shutdown()
        os.environ.clear()
        os.environ.update(saved_env)
        shutil.rmtree(haproxy_dir, ignore_errors=True)


def stop_router_loop(timeout_s: float = 5.0) -> None:
    """Stop the event loop this process's DeploymentHandles route on (call_deployment's).

    Ray Serve runs it in a daemon thread for the life of the process. serve.shutdown() cancels
    its routers' tasks but not the loop's own monitor, which goes on recording metrics every few
    seconds into a core worker that ray.shutdown() has torn down; the suite once passed and then
    segfaulted at exit with that thread alive. A handle made later starts a fresh loop (the
    class makes one when it has none)."""
    from ray.serve._private.router import SingletonThreadRouter as router

    with router._asyncio_loop_creation_lock:
        loop, router._asyncio_loop, router._event_loop_monitor = router._asyncio_loop, None, None
    if loop is None:
        return

    async def cancel_all() -> None:
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    with contextlib.suppress(Exception):
        asyncio.run_coroutine_threadsafe(cancel_all(), loop).result(timeout_s)
    loop.call_soon_threadsafe(loop.stop)
    deadline = time.monotonic() + timeout_s
    while loop.is_running() and time.monotonic() < deadline:
        time.sleep(0.01)
    if not loop.is_running():
        loop.close()


def _haproxy_private_env(state: str) -> dict[str, str]:
    """HAProxy's files and side ports for this cluster only: its defaults (/tmp/haproxy-serve,
    ports 8404 and 9101) would collide with a `make serve` running on the same machine."""
    return {"RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": f"{state}/haproxy.cfg",
            "RAY_SERVE_HAPROXY_SOCKET_PATH": f"{state}/admin.sock",
            "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": state,
            "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": f"{state}/server-state",
            "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": f"{state}/metrics.sock",
            "RAY_SERVE_HAPROXY_STATS_PORT": str(free_port()),
            "RAY_SERVE_HAPROXY_METRICS_PORT": str(free_port())}


def call_deployment(deployment: str, method: str, *args: Any) -> Any:
    """Call one method of a running deployment from synchronous code (one replica: benchmarks, tests)."""
    from ray import serve

    handle = serve.get_deployment_handle(deployment, app_name=APP_NAME)
    # The router on Ray's own loop: under RAY_SERVE_THROUGHPUT_OPTIMIZED it would run on the
    # caller's event loop, and a plain `.remote().result()` outside one is refused.
    if not handle.is_initialized:  # get_deployment_handle hands out one cached handle
        handle._init(_run_router_in_separate_loop=True)
    return getattr(handle, method).remote(*args).result()


def engine_deployment() -> str:
    """The deployment whose replicas run the engine: the EngineDeployment, or with colocate_ingress the Ingress."""
    from ray import serve

    return "EngineDeployment" if "EngineDeployment" in serve.status().applications[APP_NAME].deployments \
        else "Ingress"


def reconfigure_ingress(user_config: dict[str, Any]) -> None:
    """Apply an Ingress user_config on the running replica (what Serve does on a user_config change)."""
    call_deployment("Ingress", "reconfigure", user_config)


def reconfigure_engine(user_config: dict[str, Any]) -> None:
    """Apply an EngineDeployment user_config on its running replica (what a user_config change does)."""
    call_deployment("EngineDeployment", "reconfigure", user_config)
