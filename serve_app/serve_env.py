"""The one declaration of the environment Ray Serve needs, read by Ray's processes when they start.

Serve reads these at import time in every Ray process (controller, proxy, replicas), so they are
environment, not app args, and must be set before Ray starts: by `rayllm serve`
(serve_app/cli/serve.py), `serve_app.local` (tests, benchmarks), the image (deploy/Dockerfile) and
the RayService (deploy/rayservice.yaml). tests/test_cli.py checks that those files carry
`SERVE_ENV` as declared here, and that the Makefile serves through `rayllm serve`.

A value already in the environment wins (`apply`), so `RAY_SERVE_ENABLE_HA_PROXY=0 rayllm serve ...`
turns a setting off without an edit.
"""
from __future__ import annotations

import os
from collections.abc import MutableMapping

from engine.executor.network_utils import free_port

# Ray Serve's high-throughput mode (Ray docs: "Enable High Throughput on Ray Serve"): HAProxy takes
# the HTTP port in place of the Python ProxyActor and forwards to the Ingress replica's own HTTP
# server, and replicas talk gRPC (about half the serving path's CPU per token: docs/benchmarks.md,
# "Serving overhead"). "0" for both: Serve's Python proxy.
HIGH_THROUGHPUT_ENV = {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"}
PYTHON_PROXY_ENV = dict.fromkeys(HIGH_THROUGHPUT_ENV, "0")
# Serve's controller reconciles every 0.1 s by default and each pass costs CPU taken from the
# engine; autoscaling and health checks work in seconds, so 0.5 s is enough (docs/benchmarks.md).
CONTROL_LOOP_ENV = {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5"}
# Everywhere Serve runs: the image, the RayService, the Makefile's `rayllm serve`, serve_app.local.
SERVE_ENV = {**HIGH_THROUGHPUT_ENV, **CONTROL_LOOP_ENV}

# A stopping direct-ingress replica stays reachable this long so that load balancers in front can
# deregister it. Ray's default, 30 s, is for Kubernetes (the RayService keeps it: its Service's
# endpoints need the time); on one node HAProxy is the only balancer, reloaded as the replica
# stops, and the 30 s made every stop of `serve run` wait for it and then miss serve.shutdown's
# own 30 s ("Controller failed to shut down within 30.0s").
DRAINING_PERIOD_ENV = {"RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "1"}
# On a single node (`rayllm serve`, serve_app.local): SERVE_ENV and the short draining period.
LOCAL_SERVE_ENV = {**SERVE_ENV, **DRAINING_PERIOD_ENV}


def apply(environ: MutableMapping[str, str] | None = None, high_throughput: bool = True) -> dict[str, str]:
    """Set LOCAL_SERVE_ENV in `environ` (default os.environ) where a variable is not set already;
    high_throughput=False forces Serve's Python proxy. Returns what the environment now holds for
    these variables. Call before Ray starts: its processes read them once."""
    environ = os.environ if environ is None else environ
    for name, value in LOCAL_SERVE_ENV.items():
        environ.setdefault(name, value)
    if not high_throughput:
        environ.update(PYTHON_PROXY_ENV)
    return {name: environ[name] for name in LOCAL_SERVE_ENV}


def haproxy_private_env(state_dir: str) -> dict[str, str]:
    """HAProxy's files and side ports for one cluster only: its defaults (/tmp/haproxy-serve, ports
    8404 and 9101) would collide with another server on the same machine."""
    return {"RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": f"{state_dir}/haproxy.cfg",
            "RAY_SERVE_HAPROXY_SOCKET_PATH": f"{state_dir}/admin.sock",
            "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": state_dir,
            "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": f"{state_dir}/server-state",
            "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": f"{state_dir}/metrics.sock",
            "RAY_SERVE_HAPROXY_STATS_PORT": str(free_port()),
            "RAY_SERVE_HAPROXY_METRICS_PORT": str(free_port())}
