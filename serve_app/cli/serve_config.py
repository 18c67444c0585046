"""`rayllm serve --config FILE`: a Ray Serve config file (deploy/config.yaml), run as `serve run FILE`
would, but with Serve's environment (serve_app/serve_env.py) set before Ray starts, the same checks
first (each app's args and checkpoint, the port), and the same ready lines and clean stop.
`--host`/`--port` override the file's http_options."""
from __future__ import annotations

import argparse

from serve_app.cli import server
from serve_app.cli.preflight import CliError, check_app_args, check_port_free

OUR_IMPORT_PATH = "serve_app.app:build_app"


def load_config(path: str, host: str | None, port: int | None):
    """The file as Serve's own schema (a bad file fails naming the problem), with host/port overridden."""
    import yaml
    from pydantic import ValidationError
    from ray.serve.schema import ServeDeploySchema

    try:
        with open(path) as f:
            raw = yaml.safe_load(f) or {}
        config = ServeDeploySchema.model_validate(raw)
    except (OSError, yaml.YAMLError) as e:
        raise CliError(f"--config {path}: {e}") from None
    except ValidationError as e:
        raise CliError(f"--config {path}: not a Serve config file: {e.errors()[0]['msg']} "
                       f"at {'.'.join(map(str, e.errors()[0]['loc']))}") from None
    http = config.http_options
    config.http_options = http.model_copy(update={"host": host or http.host, "port": port or http.port})
    return config


def run_config(ns: argparse.Namespace) -> int:
    config = load_config(ns.config, ns.host, ns.port)
    ours = [app for app in config.applications if app.import_path == OUR_IMPORT_PATH]
    # Relative model paths are relative to the directory serve runs in: check them from there.
    for app in ours:
        check_app_args(dict(app.args or {}))
    options = server.ServerOptions.from_flags(ns, config.http_options.host, config.http_options.port)
    check_port_free(options.host, options.port)
    url = options.url
    with server.serve_environment(options.high_throughput) as env:
        try:
            with server.running_cluster(options, config.http_options.model_dump(), config.proxy_location):
                server.say(f"loading {len(config.applications)} app(s) from {ns.config}")
                _deploy(config)
                for app in config.applications:
                    prefix = (app.route_prefix or "/").rstrip("/")
                    key = (app.args or {}).get("api_key") if app in ours else None
                    name = server.wait_for_http(url + prefix, key, lambda a=app.name: server.app_failure(a))
                    server.print_ready(url + prefix, name, f"app {app.name}, {options.proxy_name}", env, key)
                server.wait_for_signal()
        except (server.Stop, KeyboardInterrupt):
            return 0
    return 0


def _deploy(config) -> None:
    from ray.serve.context import _get_global_client

    # What `serve run FILE` does: the controller builds each app from its import path and args.
    _get_global_client().deploy_apps(config, _blocking=False)
