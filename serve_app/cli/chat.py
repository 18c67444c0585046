"""`rayllm chat [--url URL] [--system TEXT]`: an interactive chat in the terminal against a running
server (POST /v1/chat/completions, streamed). The conversation is kept and sent whole each turn;
`/reset` forgets it, `/exit` or Ctrl-D leaves."""
from __future__ import annotations

import sys

from serve_app.cli.client import Client, add_endpoint_args, add_model_arg
from serve_app.cli.complete import add_sampling_args, sampling_body
from serve_app.cli.preflight import CliError


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("chat", help="chat with a running server in the terminal", description=__doc__)
    add_endpoint_args(p)
    add_model_arg(p)
    p.add_argument("--system", help="a system message to start the conversation with")
    add_sampling_args(p)
    p.set_defaults(run=run)


def run(ns) -> int:
    client = Client(ns.url, ns.api_key)
    model = client.model_name(ns.model)
    start = [{"role": "system", "content": ns.system}] if ns.system else []
    messages = list(start)
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"chatting with {model} at {client.base} (/reset forgets, /exit or Ctrl-D leaves)")
    while True:
        try:
            text = input("you> " if interactive else "")
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if text.strip() in ("/exit", "/quit"):
            return 0
        if text.strip() == "/reset":
            messages = list(start)
            continue
        if not text.strip():
            continue
        messages.append({"role": "user", "content": text})
        messages.append({"role": "assistant", "content": _reply(client, model, messages, ns, interactive)})


def _reply(client: Client, model: str, messages: list[dict], ns, interactive: bool) -> str:
    """Stream one answer to stdout; return its text (what was received if Ctrl-C cut it short)."""
    parts = []
    if interactive:
        print(f"{model}> ", end="", flush=True)
    try:
        for chunk in client.stream("/chat/completions", {"model": model, "messages": messages, **sampling_body(ns)}):
            for choice in chunk.get("choices", []):
                delta = choice.get("delta", {}).get("content") or ""
                parts.append(delta)
                print(delta, end="", flush=True)
    except KeyboardInterrupt:
        print(" [interrupted]", end="")
    except CliError as e:
        print(f"\n[error: {e}]", end="")
    print(flush=True)
    return "".join(parts)
