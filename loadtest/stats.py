"""Percentiles and the knee of a concurrency sweep; pure Python."""
from __future__ import annotations

import math

PERCENTILES = (50, 90, 99)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile with linear interpolation between closest ranks (numpy's default).

    On n sorted values the rank is q/100 * (n - 1): p50 of [1, 2, 3, 4] is 2.5.
    """
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"q={q} must be in [0, 100]")
    ordered = sorted(values)
    rank = q / 100 * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(values: list[float]) -> dict[str, float | None]:
    """mean and p50/p90/p99 (None for all when there are no samples, e.g. every request failed)."""
    keys = ["mean"] + [f"p{q}" for q in PERCENTILES]
    if not values:
        return dict.fromkeys(keys) | {"count": 0}
    out = {"mean": sum(values) / len(values)}
    out.update({f"p{q}": percentile(values, q) for q in PERCENTILES})
    out["count"] = len(values)
    return out


def find_knee(levels: list[tuple[int, float, float]]) -> dict:
    """The knee of a concurrency sweep, from (concurrency, p50 latency, throughput) per level.

    Between two consecutive levels (sorted by concurrency), latency grows by
    L1 / L0 and throughput by X1 / X0. The knee is the last concurrency before
    the first step where latency grows faster than throughput (L1 / L0 > X1 / X0):
    beyond it, more load buys less throughput than it costs in latency.

    In a closed loop of c clients Little's law gives X ~ c / L, so the condition
    reads L1 / L0 > sqrt(c1 / c0): latency growing faster than the square root
    of the load. When no step meets it the knee lies beyond the sweep: the
    highest concurrency tested is returned with `reached=False`. A level with
    zero throughput (every request failed) counts as past the knee.
    """
    if not levels:
        raise ValueError("find_knee needs at least one level")
    ordered = sorted(levels)
    for (c0, lat0, thr0), (c1, lat1, thr1) in zip(ordered, ordered[1:]):
        if thr0 <= 0 or lat0 <= 0:
            return {"concurrency": c0, "reached": True, "reason": f"no throughput at concurrency {c0}"}
        latency_growth, throughput_growth = lat1 / lat0, thr1 / thr0
        if thr1 <= 0 or latency_growth > throughput_growth:
            return {"concurrency": c0, "reached": True,
                    "reason": (f"{c0}->{c1}: p50 latency x{latency_growth:.2f} > "
                               f"throughput x{throughput_growth:.2f}")}
    return {"concurrency": ordered[-1][0], "reached": False,
            "reason": "latency never grew faster than throughput: the knee lies beyond the sweep"}
