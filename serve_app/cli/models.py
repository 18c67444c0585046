"""`rayllm models [--url URL]`: the models a running server serves (GET /v1/models), one id a line."""
from __future__ import annotations

from serve_app.cli.client import Client, add_endpoint_args


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("models", help="list the models a running server serves", description=__doc__)
    add_endpoint_args(p)
    p.set_defaults(run=run)


def run(ns) -> int:
    for model in Client(ns.url, ns.api_key).models():
        print(model["id"])
    return 0
