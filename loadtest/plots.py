"""PNG plots of online runs: latency percentiles and throughput against the load (concurrency or rate).

One run (`python -m loadtest`) or several on the same axes (`python -m loadtest compare`),
so the knee of each server shows beside the others'.
"""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on servers and CI
import matplotlib.pyplot as plt  # noqa: E402

LATENCY_METRICS = (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl_s", "ITL"), ("e2e_s", "E2E latency"))
AXIS_LABELS = {"concurrency": "concurrency (closed loop)", "request_rate": "request rate, req/s (open loop)"}
Run = tuple[str, dict]  # (label, results.json)


def load_kind(results: dict) -> str:
    levels = results["levels"]
    return "request_rate" if levels and "request_rate" in levels[0] else "concurrency"


def _inf_at(levels: list[dict], kind: str) -> float:
    """Where rate=inf (everything at once) is drawn: one octave past the highest finite load."""
    finite = [lv[kind] for lv in levels if lv[kind] != float("inf")]
    return 2 * max(finite) if finite else 1.0


def _points(levels: list[dict], kind: str, value, inf_at: float) -> tuple[list[float], list[float]]:
    """(x, y) sorted by load: a ramp's repeated rates plot as points on one line."""
    pairs = sorted((min(lv[kind], inf_at), value(lv)) for lv in levels)
    return [x for x, _ in pairs], [y for _, y in pairs]


def _all_levels(runs: list[Run]) -> list[dict]:
    return [lv for _, r in runs for lv in r["levels"]]


def _load_axis(ax, runs: list[Run], kind: str, inf_at: float) -> None:
    loads = sorted({lv[kind] for lv in _all_levels(runs)})
    ax.set_xscale("log", base=2)
    ax.set_xticks([min(t, inf_at) for t in loads])
    ax.set_xticklabels([f"{t:g}" for t in loads])
    ax.set_xlabel(AXIS_LABELS[kind])
    ax.grid(True, alpha=0.3)


def plot_latency(runs: list[Run], path: Path, title: str) -> Path:
    """2 x 2 panels (TTFT, TPOT, ITL, E2E) in ms: p50/p90/p99 of one run, or p50 (solid) and p99
    (dashed) of each of several runs, a colour per run."""
    kind = load_kind(runs[0][1])
    inf_at = _inf_at(_all_levels(runs), kind)
    quantiles = ("p50", "p90", "p99") if len(runs) == 1 else ("p50", "p99")
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (key, label) in zip(axes.flat, LATENCY_METRICS):
        for i, (name, results) in enumerate(runs):
            for q in quantiles:
                def ms(lv, key=key, q=q):
                    return lv[key][q] * 1e3 if lv[key][q] is not None else float("nan")
                xs, ys = _points(results["levels"], kind, ms, inf_at)
                style = {} if len(runs) == 1 else {"color": f"C{i}", "linestyle": "-" if q == "p50" else "--"}
                ax.plot(xs, ys, marker="o", label=q if len(runs) == 1 else f"{name} {q}", **style)
        ax.set_title(label)
        ax.set_ylabel("ms")
        _load_axis(ax, runs, kind, inf_at)
        ax.legend(fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_throughput(runs: list[Run], path: Path, title: str) -> Path:
    """Output tokens/s of each run, its knee marked (one run: requests/s on a second axis)."""
    kind = load_kind(runs[0][1])
    inf_at = _inf_at(_all_levels(runs), kind)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (name, results) in enumerate(runs):
        xs, ys = _points(results["levels"], kind, lambda lv: lv["output_token_throughput"], inf_at)
        ax.plot(xs, ys, marker="o", color=f"C{i}", label=f"{name} tokens/s")
        knee = results["knee"]
        at = knee.get(kind, knee.get("concurrency"))
        ax.axvline(min(at, inf_at), color=f"C{i}", linestyle=":", alpha=0.7,
                   label=f"{name} knee: {at:g}" + ("" if knee["reached"] else " (not reached)"))
    ax.set_ylabel("output tokens/s")
    if len(runs) == 1:
        twin = ax.twinx()
        xs, ys = _points(runs[0][1]["levels"], kind, lambda lv: lv["request_throughput"], inf_at)
        twin.plot(xs, ys, marker="s", color="C1")
        twin.set_ylabel("requests/s", color="C1")
    _load_axis(ax, runs, kind, inf_at)
    ax.legend(loc="upper left", fontsize="small")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_plots(results: dict, out_dir: Path) -> list[Path]:
    title = f"{results['config']['model']} @ {results['url']}"
    kind = load_kind(results)
    runs = [(results["config"]["model"], results)]
    return [plot_latency(runs, out_dir / f"latency_vs_{kind}.png", title),
            plot_throughput(runs, out_dir / f"throughput_vs_{kind}.png", title)]
