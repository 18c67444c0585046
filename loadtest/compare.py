"""`python -m loadtest compare A/results.json B/results.json ... --out DIR`: several runs on the same plots.

Each results.json is one `python -m loadtest` run (ours, vLLM, any OpenAI-compatible server),
all of the same kind (all closed-loop concurrency sweeps, or all request-rate sweeps), so a
reader sees each server's latency and throughput against the same load, and each knee.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from loadtest.plots import load_kind, plot_latency, plot_throughput
from loadtest.report import format_table


def load_runs(paths: list[Path], labels: list[str] | None) -> list[tuple[str, dict]]:
    """(label, results) per file; ValueError naming the file that is missing, unreadable or of another kind."""
    if len(paths) < 2:
        raise ValueError(f"compare needs at least two results.json, got {len(paths)}")
    if labels is not None and len(labels) != len(paths):
        raise ValueError(f"--labels has {len(labels)} names for {len(paths)} results")
    runs = []
    for i, path in enumerate(paths):
        try:
            results = json.loads(Path(path).read_text())
            levels = results["levels"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}: not a `python -m loadtest` results.json ({type(e).__name__}: {e})") from None
        if not levels:
            raise ValueError(f"{path}: has no levels")
        label = labels[i] if labels else _default_label(path, results)
        runs.append((label, results))
    kinds = {load_kind(r) for _, r in runs}
    if len(kinds) > 1:
        raise ValueError(f"cannot compare a concurrency sweep with a request-rate sweep: {sorted(kinds)}")
    return runs


def _default_label(path: Path, results: dict) -> str:
    return Path(path).resolve().parent.name or results.get("url", str(path))


def comparison_table(runs: list[tuple[str, dict]]) -> str:
    kind = load_kind(runs[0][1])
    rows = []
    for name, results in runs:
        for lv in results["levels"]:
            p50 = lambda key: "-" if lv[key]["p50"] is None else lv[key]["p50"] * 1e3  # noqa: E731
            rows.append([name, lv[kind], lv["output_token_throughput"], p50("ttft_s"), p50("itl_s"),
                         p50("e2e_s"), lv["num_errors"]])
    header = ["run", kind, "out tok/s", "TTFT p50 ms", "ITL p50 ms", "E2E p50 ms", "errors"]
    knees = "; ".join(f"{name}: knee at {r['knee'].get(kind, r['knee'].get('concurrency'))}"
                      + ("" if r["knee"]["reached"] else " (not reached)") for name, r in runs)
    return f"{format_table(header, rows)}\n{knees}"


def main(argv: list[str]) -> list[Path]:
    ap = argparse.ArgumentParser(prog="python -m loadtest compare", description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", type=Path, help="two or more results.json of python -m loadtest")
    ap.add_argument("--labels", type=lambda s: s.split(","), default=None, help="comma-separated, one per file")
    ap.add_argument("--out", type=Path, default=Path("bench_out/compare"))
    ap.add_argument("--title", default="side by side")
    args = ap.parse_args(argv)
    try:
        runs = load_runs(args.results, args.labels)
    except ValueError as e:
        ap.error(str(e))
    args.out.mkdir(parents=True, exist_ok=True)
    kind = load_kind(runs[0][1])
    plots = [plot_latency(runs, args.out / f"latency_vs_{kind}.png", args.title),
             plot_throughput(runs, args.out / f"throughput_vs_{kind}.png", args.title)]
    print(comparison_table(runs))
    print(f"wrote {', '.join(str(p) for p in plots)}")
    return plots
