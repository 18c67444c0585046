"""Run the application in this process's own local Ray cluster, on a free loopback port.

For tests and benchmarks (`serve run deploy/config.yaml` is the way to serve for real):

    with local_server({"model": "models/tiny-llama", "device": "cpu"}) as url:
        ...  # OpenAI-compatible endpoint at url + "/v1"
"""
from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path
from typing import Any, Iterator

APP_NAME = "llm"
_REPO_ROOT = str(Path(__file__).resolve().parents[1])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def local_server(args: dict[str, Any], num_cpus: int | None = None) -> Iterator[str]:
    """Start Ray + Serve + the app; yield the base URL; shut everything down after."""
    import ray
    from ray import serve

    from serve_app.app import build_app

    port = free_port()
    # Replicas import serve_app from this checkout even when the package is not installed.
    path = os.pathsep.join(p for p in (_REPO_ROOT, os.environ.get("PYTHONPATH")) if p)
    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True,
             runtime_env={"env_vars": {"PYTHONPATH": path, "TOKENIZERS_PARALLELISM": "false"}})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(args), name=APP_NAME, route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()


def reconfigure_ingress(user_config: dict[str, Any]) -> None:
    """Apply an Ingress user_config on the running replica (what Serve does on a user_config change)."""
    from ray import serve

    serve.get_deployment_handle("Ingress", app_name=APP_NAME).reconfigure.remote(user_config).result()


def reconfigure_engine(user_config: dict[str, Any]) -> None:
    """Apply an EngineDeployment user_config on its running replica (one replica: benchmarks, tests)."""
    from ray import serve

    serve.get_deployment_handle("EngineDeployment", app_name=APP_NAME).reconfigure.remote(user_config).result()
