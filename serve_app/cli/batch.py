"""`rayllm batch ...`: the offline batch job, `python -m serve_app.batch ...` (serve_app/batch/__main__.py)."""
from __future__ import annotations


def add_parser(subparsers) -> None:
    subparsers.add_parser("batch", add_help=False, help="run a batch job over a file of prompts "
                                                        "(python -m serve_app.batch; `rayllm batch --help`)")


def forward(argv: list[str]) -> int:
    from serve_app.batch.__main__ import main

    return main(argv)
