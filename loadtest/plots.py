"""PNG plots of an online sweep: latency and throughput against concurrency."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on servers and CI
import matplotlib.pyplot as plt  # noqa: E402

LATENCY_METRICS = (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl_s", "ITL"), ("e2e_s", "E2E latency"))


def _concurrency_axis(ax, levels: list[dict]) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks([lv["concurrency"] for lv in levels])
    ax.set_xticklabels([str(lv["concurrency"]) for lv in levels])
    ax.set_xlabel("concurrency")
    ax.grid(True, alpha=0.3)


def plot_latency(levels: list[dict], path: Path, title: str) -> Path:
    """2 x 2 panels, p50/p90/p99 of TTFT, TPOT, ITL and E2E, in milliseconds."""
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    xs = [lv["concurrency"] for lv in levels]
    for ax, (key, label) in zip(axes.flat, LATENCY_METRICS):
        for q in ("p50", "p90", "p99"):
            ys = [lv[key][q] * 1e3 if lv[key][q] is not None else float("nan") for lv in levels]
            ax.plot(xs, ys, marker="o", label=q)
        ax.set_title(label)
        ax.set_ylabel("ms")
        _concurrency_axis(ax, levels)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_throughput(levels: list[dict], knee: dict, path: Path, title: str) -> Path:
    """Output tokens/s and requests/s, the knee marked."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = [lv["concurrency"] for lv in levels]
    ax.plot(xs, [lv["output_token_throughput"] for lv in levels], marker="o", color="C0")
    ax.set_ylabel("output tokens/s", color="C0")
    twin = ax.twinx()
    twin.plot(xs, [lv["request_throughput"] for lv in levels], marker="s", color="C1")
    twin.set_ylabel("requests/s", color="C1")
    _concurrency_axis(ax, levels)
    ax.axvline(knee["concurrency"], color="gray", linestyle="--",
               label=f"knee: {knee['concurrency']}" + ("" if knee["reached"] else " (not reached)"))
    ax.legend(loc="upper left")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_plots(results: dict, out_dir: Path) -> list[Path]:
    title = f"{results['config']['model']} @ {results['url']}"
    return [plot_latency(results["levels"], out_dir / "latency_vs_concurrency.png", title),
            plot_throughput(results["levels"], results["knee"], out_dir / "throughput_vs_concurrency.png", title)]
