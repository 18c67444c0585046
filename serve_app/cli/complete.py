"""`rayllm complete PROMPT [--max-tokens N ...]`: one completion from a running server
(POST /v1/completions), streamed to stdout as it is generated. `-` reads the prompt from stdin."""
from __future__ import annotations

import sys

from serve_app.cli.client import Client, add_endpoint_args, add_model_arg


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("complete", help="complete a prompt against a running server", description=__doc__)
    p.add_argument("prompt", metavar="PROMPT", help="the text to continue ('-': read it from stdin)")
    add_endpoint_args(p)
    add_model_arg(p)
    add_sampling_args(p)
    p.set_defaults(run=run)


def add_sampling_args(p) -> None:
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=None, help="[default: the server's, 1.0]")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)


def sampling_body(ns) -> dict:
    body = {"max_tokens": ns.max_tokens, "temperature": ns.temperature, "top_p": ns.top_p, "seed": ns.seed}
    return {k: v for k, v in body.items() if v is not None}


def run(ns) -> int:
    prompt = sys.stdin.read() if ns.prompt == "-" else ns.prompt
    client = Client(ns.url, ns.api_key)
    body = {"model": client.model_name(ns.model), "prompt": prompt, **sampling_body(ns)}
    for chunk in client.stream("/completions", body):
        for choice in chunk.get("choices", []):
            print(choice.get("text", ""), end="", flush=True)
    print()
    return 0
