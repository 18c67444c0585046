"""The autoscaling demo over time: engine replicas, tokens/s per replica, and request latency."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only
import matplotlib.pyplot as plt  # noqa: E402


def token_rates(samples: list[dict]) -> tuple[list[float], dict[str, list[float]]]:
    """(times, {replica: tokens/s}) between consecutive samples (counters to rates)."""
    times, rates = [], {}
    replicas = sorted({r for s in samples for r in s["tokens_by_replica"]})
    for prev, cur in zip(samples, samples[1:]):
        dt = cur["t_s"] - prev["t_s"]
        if dt <= 0:
            continue
        times.append(cur["t_s"])
        for r in replicas:
            delta = cur["tokens_by_replica"].get(r, 0.0) - prev["tokens_by_replica"].get(r, 0.0)
            rates.setdefault(r, []).append(max(delta, 0.0) / dt)
    return times, rates


def plot_autoscale(results: dict, path: Path) -> Path:
    samples = results["samples"]
    fig, (ax_r, ax_t, ax_l) = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    ts = [s["t_s"] for s in samples]
    ax_r.step(ts, [s["running"] for s in samples], where="post", label="RUNNING")
    ax_r.step(ts, [sum(s["replica_states"].values()) for s in samples], where="post", linestyle="--",
              label="all states (starting, stopping)")
    ax_r.set_ylabel("engine replicas")
    ax_r.set_yticks([0, 1, 2])
    ax_r.legend(loc="upper right", fontsize="small")
    times, rates = token_rates(samples)
    for i, (replica, ys) in enumerate(rates.items()):
        ax_t.plot(times, ys, label=f"replica {replica}", color=f"C{i}")
    ax_t.set_ylabel("generated tokens/s")
    ax_t.legend(loc="upper right", fontsize="small")
    timeline = [r for lv in results["levels"] for r in lv["timeline"] if r["ok"]]
    ax_l.scatter([r["sent_s"] for r in timeline], [r["ttft_s"] for r in timeline], s=6, label="TTFT")
    ax_l.scatter([r["sent_s"] for r in timeline], [r["e2e_s"] for r in timeline], s=6, label="E2E")
    ax_l.set_ylabel("seconds (by send time)")
    ax_l.set_xlabel("seconds since start")
    ax_l.legend(loc="upper right", fontsize="small")
    for ax in (ax_r, ax_t, ax_l):
        ax.axvspan(*results["load_window_s"], color="gray", alpha=0.1)
        ax.grid(True, alpha=0.3)
    rates_txt = ", ".join(f"{lv['request_rate']:g}" for lv in results["levels"])
    fig.suptitle(f"Engine autoscaling 1..2 under a request-rate ramp ({rates_txt} req/s; load shaded)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
