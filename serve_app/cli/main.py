"""`rayllm`'s entry point (pyproject.toml [project.scripts]): one sub-command per module of this package.

Each verb module has `add_parser(subparsers)`, which sets `run(namespace) -> exit status`; heavy
imports (Ray, torch) happen inside `run`, so `rayllm --help` answers at once.
"""
from __future__ import annotations

import argparse
import os
import sys

from serve_app.cli import batch, bench, chat, complete, models, serve
from serve_app.cli.preflight import CliError

VERBS = (serve, chat, complete, models, bench, batch)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rayllm", description="Serve and query LLMs with our engine behind Ray Serve (docs/serving.md).")
    subparsers = parser.add_subparsers(dest="verb", metavar="COMMAND", required=True)
    for verb in VERBS:
        verb.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["bench"], ["batch"]):  # their own CLIs parse the rest, --help included
        return {"bench": bench, "batch": batch}[argv[0]].forward(argv[1:])
    ns = build_parser().parse_args(argv)
    try:
        return ns.run(ns)
    except CliError as e:
        print(f"rayllm {ns.verb}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C before anything needed stopping
        return 130


def console_main() -> None:
    status = main()
    if "ray" in sys.modules:
        # Ray was started and shut down here (serve, batch): leave without the interpreter's native
        # teardown of Ray's core worker, which takes seconds after ray.shutdown() and has crashed
        # at exit (tests/conftest.py says the same of the test process).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    sys.exit(status)
