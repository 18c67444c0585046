"""`rayllm bench ...`: the online load test, `python -m loadtest ...` (loadtest/__main__.py), same arguments."""
from __future__ import annotations


def add_parser(subparsers) -> None:
    subparsers.add_parser("bench", add_help=False, help="load-test a running endpoint (python -m loadtest; "
                                                        "`rayllm bench --help`)")


def forward(argv: list[str]) -> int:
    from loadtest.__main__ import main

    main(argv)
    return 0
