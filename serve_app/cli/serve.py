"""`rayllm serve MODEL [--app-arg VALUE ...]`: the app on a local Ray cluster, at full speed, until
Ctrl-C or SIGTERM.

Before Ray starts, in this order: the args and the checkpoint (a missing path, an unsupported
architecture), the port, the device; each failure is one line and exit status 2. Then Serve's
environment (serve_app/serve_env.py), the shape chosen from the hardware (colocated on CPU, three
deployments on a GPU host; `--colocate-ingress` decides otherwise), and the ready lines once
/v1/models answers.
"""
from __future__ import annotations

import argparse
from typing import Any

from serve_app.cli import server
from serve_app.cli.app_flags import add_app_flags, app_args_from
from serve_app.cli.preflight import CliError, check_app_args, check_device, check_port_free, has_gpu

APP_NAME = "llm"


def add_parser(subparsers) -> None:
    from serve_app.args import AppArgs

    p = subparsers.add_parser(
        "serve", help="serve a model (OpenAI-compatible HTTP) on this machine", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", metavar="MODEL",
                   help="checkpoint directory, .gguf file (or a directory holding one), or a cached hub id")
    p.add_argument("--host", default=None, help="address to listen on [default: 127.0.0.1]")
    p.add_argument("--port", type=int, default=None, help="HTTP port [default: 8000]")
    p.add_argument("--config", metavar="FILE",
                   help="run a Ray Serve config file (deploy/config.yaml) with the same environment, in place of MODEL")
    p.add_argument("--python-proxy", action="store_true",
                   help="Serve's Python proxy instead of its high-throughput mode (HAProxy, gRPC between replicas)")
    p.add_argument("--dashboard", action="store_true",
                   help="start Ray's dashboard too (127.0.0.1:8265: the web UI, `serve status`); off: less CPU")
    add_app_flags(p, AppArgs)
    p.set_defaults(run=run)


def run(ns: argparse.Namespace) -> int:
    if ns.config:
        from serve_app.cli.serve_config import run_config

        return run_config(ns)
    if not ns.model:
        raise CliError("MODEL is required (a checkpoint directory, a .gguf file or a cached hub id), or --config FILE")
    from serve_app.args import AppArgs

    args = {**app_args_from(ns, AppArgs), "model": ns.model}
    check_app_args(args)  # the checkpoint first: the commonest mistake, and no torch import needed
    options = server.ServerOptions.from_flags(ns, ns.host or "127.0.0.1", ns.port or 8000)
    check_port_free(options.host, options.port)
    args = choose_shape(args)
    app_args = check_app_args(args)
    return serve_app(args, options, describe_shape(app_args.device, app_args.colocate_ingress), app_args.api_key)



def choose_shape(args: dict[str, Any]) -> dict[str, Any]:
    """The device ('auto': a GPU if torch sees one) and, unless given, the shape: colocated where the
    node's CPUs run the engine too (device cpu), three deployments on a GPU host
    (docs/serving.md, "One deployment instead of three")."""
    device = str(args.get("device", "auto"))
    if device == "auto":
        device = "cuda" if has_gpu() else "cpu"
    check_device(device)
    args = {**args, "device": device}
    # Colocated has one Ingress per engine replica: not with --ingress-replicas, nor with a router
    # between Ingress and engines to pick (prefix_affinity: docs/fleet.md).
    args.setdefault("colocate_ingress", device == "cpu" and "ingress_replicas" not in args
                    and args.get("request_router") != "prefix_affinity")
    return args


def describe_shape(device: str, colocated: Any) -> str:
    deployments = "colocated: one deployment" if colocated else "three deployments"
    return f"device {device}, {deployments}"


def serve_app(args: dict[str, Any], options: server.ServerOptions, shape: str, api_key: str | None) -> int:
    """Start Ray and Serve, deploy `args`, print the ready lines, serve until a signal; exit status."""
    shape = f"{shape}, {options.proxy_name}"
    with server.serve_environment(options.high_throughput) as env:
        try:
            with server.running_cluster(options):
                server.say(f"loading model {args['model']} ({shape})")
                _deploy(args)
                name = server.wait_for_http(options.url, api_key, lambda: server.app_failure(APP_NAME))
                server.print_ready(options.url, name, shape, env, api_key)
                server.wait_for_signal()
        except (server.Stop, KeyboardInterrupt):
            return 0
    return 0


def _deploy(args: dict[str, Any]) -> None:
    from ray import serve

    from serve_app.app import build_app

    try:
        app = build_app(args)
    except ValueError as e:
        raise CliError(str(e)) from None
    try:
        serve.run(app, name=APP_NAME, route_prefix="/")  # returns once the replicas are up
    except RuntimeError:
        raise CliError(server.failure_reason(APP_NAME)) from None
