"""One local Ray cluster serving until a signal: `rayllm serve`'s life after its checks.

    start (environment, Ray, Serve on host:port) -> deploy -> wait for HTTP -> ready lines
    -> wait for Ctrl-C / SIGTERM / SIGINT -> Serve shutdown (replicas drain) -> Ray shutdown

The process that starts Ray is the driver of its cluster: `ray.shutdown()` here stops the raylet,
the GCS and every worker, and Serve's shutdown stops HAProxy with the proxy, so nothing outlives
this process.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from serve_app import serve_env
from serve_app.cli.preflight import CliError

# The package's parent directory: replicas import serve_app from it even when it is not installed.
_SOURCE_ROOT = str(Path(__file__).resolve().parents[2])


class Stop(BaseException):
    """Raised in the main thread by SIGTERM or SIGINT: stop serving."""


def _raise_stop(signum, frame):
    raise Stop(signal.Signals(signum).name)


def _already_stopping(signum, frame):
    print("rayllm: already stopping (draining in-flight requests)", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class ServerOptions:
    """How `rayllm serve` runs Serve, whatever the app."""

    host: str = "127.0.0.1"       # where Serve's proxy listens
    port: int = 8000
    high_throughput: bool = True  # HAProxy + gRPC (serve_env.HIGH_THROUGHPUT_ENV); False: Serve's Python proxy
    dashboard: bool = False       # Ray's dashboard (the web UI, `serve status`): a process and a port more

    @classmethod
    def from_flags(cls, ns, host: str, port: int) -> "ServerOptions":
        """From `rayllm serve`'s flags; host and port as resolved (flag, config file or default)."""
        return cls(host=host, port=port, high_throughput=not ns.python_proxy, dashboard=ns.dashboard)

    @property
    def url(self) -> str:
        """Where this machine reaches the server."""
        return f"http://{'127.0.0.1' if self.host in ('0.0.0.0', '') else self.host}:{self.port}"

    @property
    def proxy_name(self) -> str:
        return "HAProxy" if self.high_throughput else "Python proxy"


def say(message: str) -> None:
    print(f"rayllm: {message}", flush=True)


@contextlib.contextmanager
def serve_environment(high_throughput: bool) -> Iterator[dict[str, str]]:
    """serve_env's variables (a value already set wins), HAProxy's files private to this server,
    and the source root on PYTHONPATH: set before Ray starts, since its processes read them once."""
    # Short: HAProxy's unix sockets go two levels under it, and a socket path has at most 97 bytes.
    haproxy_dir = tempfile.mkdtemp(prefix="rayllm-", dir="/tmp" if os.path.isdir("/tmp") else None)
    saved = dict(os.environ)
    try:
        shown = serve_env.apply(os.environ, high_throughput)
        for name, value in serve_env.haproxy_private_env(haproxy_dir).items():
            os.environ.setdefault(name, value)
        path = os.pathsep.join(p for p in (_SOURCE_ROOT, os.environ.get("PYTHONPATH")) if p)
        os.environ.update({"PYTHONPATH": path, "TOKENIZERS_PARALLELISM": "false"})
        yield shown
    finally:
        os.environ.clear()
        os.environ.update(saved)
        shutil.rmtree(haproxy_dir, ignore_errors=True)


@contextlib.contextmanager
def running_cluster(options: ServerOptions, http_options: dict | None = None,
                    proxy_location: str | None = None) -> Iterator[None]:
    """Ray (this process its driver) and Serve's controller and proxy; both shut down after, with
    SIGTERM and SIGINT ignored meanwhile, so a second signal cannot cut the drain short.
    http_options: Serve's (a config file's), else options' host and port."""
    import ray
    from ray import serve

    http_options = {**(http_options or {}), "host": options.host, "port": options.port}
    ray.init(include_dashboard=options.dashboard, log_to_driver=True, namespace="serve")
    # After ray.init, which installs its own SIGTERM handler (sys.exit without stopping Serve). SIGINT
    # too: a process started in the background by a shell inherits SIGINT ignored.
    signal.signal(signal.SIGTERM, _raise_stop)
    signal.signal(signal.SIGINT, _raise_stop)
    try:
        try:
            serve.start(http_options=http_options, **({"proxy_location": proxy_location} if proxy_location else {}))
        except Exception as e:  # noqa: BLE001 - one line, not Ray's traceback
            raise CliError(f"Ray Serve failed to start: {last_line(str(e))} "
                           "(logs: /tmp/ray/session_latest/logs)") from None
        yield
    finally:
        signal.signal(signal.SIGTERM, _already_stopping)
        signal.signal(signal.SIGINT, _already_stopping)
        say("stopping: in-flight requests drain (up to the app's graceful_shutdown_timeout_s), then Ray stops")
        started = time.monotonic()
        with contextlib.suppress(Exception):
            # The apps first: their replicas drain while the proxy (HAProxy) still carries their
            # streams. serve.shutdown() alone stops the proxies in the same pass as the replicas,
            # which cuts every in-flight response at once.
            for name in serve.status().applications:
                serve.delete(name)
        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()
        say(f"stopped in {time.monotonic() - started:.1f} s")


def wait_for_http(url: str, api_key: str | None, is_failed: Callable[[], str | None]) -> str:
    """Poll GET url/v1/models until it answers 200; return the first model's id. `is_failed()`
    returns a reason when the app can no longer come up."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    while True:
        reason = is_failed()
        if reason:
            raise CliError(reason)
        with contextlib.suppress(httpx.HTTPError):
            response = httpx.get(f"{url}/v1/models", headers=headers, timeout=5.0)
            if response.status_code == 200:
                return response.json()["data"][0]["id"]
        time.sleep(0.25)


def app_failure(app_name: str) -> str | None:
    """Why the app will not come up (Serve's status says DEPLOY_FAILED), else None."""
    from ray import serve

    status = serve.status().applications.get(app_name)
    if status is None or status.status not in ("DEPLOY_FAILED", "UNHEALTHY"):
        return None
    return failure_reason(app_name)


def failure_reason(app_name: str) -> str:
    """One line: why the app failed, from its failing deployment's message (the replica's last
    exception line: in the high-throughput mode replicas do not log to the terminal)."""
    from ray import serve

    with contextlib.suppress(Exception):
        status = serve.status().applications[app_name]
        for name, deployment in status.deployments.items():
            if deployment.status in ("DEPLOY_FAILED", "UNHEALTHY") and deployment.message:
                return f"the app failed to start: {name}: {last_line(deployment.message)}"
        return f"the app failed to start: {last_line(status.message)}"
    return "the app failed to start (logs: /tmp/ray/session_latest/logs/serve)"


def last_line(message: str) -> str:
    lines = [line.strip() for line in (message or "").splitlines() if line.strip()]
    return lines[-1] if lines else "(no message; see /tmp/ray/session_latest/logs/serve)"


def print_ready(url: str, model_name: str, shape: str, env: dict[str, str], api_key: str | None) -> None:
    auth = " -H 'Authorization: Bearer $API_KEY'" if api_key else ""
    say(f"serving {model_name!r} at {url}/v1 ({shape})")
    say("Serve environment: " + " ".join(f"{k}={v}" for k, v in env.items()))
    say("try: curl " + f"{url}/v1/chat/completions -H 'Content-Type: application/json'{auth} -d "
        + "'{\"model\": \"" + model_name + "\", \"messages\": [{\"role\": \"user\", \"content\": \"Hello!\"}]}'")
    say("Ctrl-C (or SIGTERM) stops it")


def wait_for_signal() -> None:
    """Sleep until SIGTERM or SIGINT (Stop) arrives."""
    while True:
        signal.pause()
