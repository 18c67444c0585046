"""Speculative decoding, served: the app with drafts against the same app without, one run.

    python -m loadtest --workload spec --model models/smollm2-135m-instruct [--speculative ngram|draft] \\
        [--num-speculative-tokens 4] [--concurrency 1,4,16] [--workloads copy,random] [--num-requests 16] \\
        [--rounds 1] [--serve-arg key=value ...] [--out bench_out/online_spec.json]

The offline benchmark's two workloads (loadtest/offline_spec.py: `copy` decoded greedily, `random`
sampled at temperature 1), sent as token-id prompts to /v1/completions, streamed, at each
concurrency c as a closed loop (c clients, each sending its next request when the last one ended).
One local Ray cluster runs the app twice per round, without and with `speculative_config` (each a
fresh app, each going first in turn); every level runs on both. Reported per (workload, c): output
tok/s (the wall time of the level), TTFT and TPOT p50 of each, the speed-up, the acceptance rate and
mean acceptance length (from the app's /metrics: `spec_decode_num_*`), and for the greedy workload
how many answers differ (must be 0). Medians over rounds.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

from loadtest.client import Target, build_payload, endpoint_url, open_session, send_request
from loadtest.multiturn import _key_value
from loadtest.offline_spec import WORKLOADS, _acceptance, add_speculation_args, speculative_config
from loadtest.report import base_metadata, format_table, write_json
from loadtest.stats import summarize
from loadtest.workload import BenchRequest, prompt_id_limit

SERVED_NAME = "bench"
VARIANTS = ("baseline", "spec")
SPEC_COUNTERS = ("drafts", "draft_tokens", "accepted_tokens")


async def run_level(url: str, requests: list[BenchRequest], temperature: float, concurrency: int, seed: int,
                    timeout_s: float) -> dict:
    """The requests through `concurrency` clients; tok/s over the level's wall time, TTFT, TPOT, texts."""
    target = Target(endpoint_url(url, "completions"), "completions", {}, timeout_s)
    pending = iter(range(len(requests)))
    records: dict[int, object] = {}

    async def client_loop(session) -> None:
        for i in pending:
            body = build_payload(SERVED_NAME, requests[i].prompt_token_ids, requests[i].max_tokens, "completions")
            body.update(temperature=temperature, seed=seed + i)
            records[i] = await send_request(session, target, body)

    async with open_session(concurrency) as session:
        start = time.perf_counter()
        await asyncio.gather(*(client_loop(session) for _ in range(concurrency)))
        wall_s = time.perf_counter() - start
    done = [records[i] for i in range(len(requests))]
    failed = [r.error for r in done if not r.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} request(s) failed, first: {failed[0]}")
    if any(r.output_tokens != q.max_tokens for r, q in zip(done, requests)):
        raise RuntimeError("a request returned the wrong number of tokens")  # never count tokens not made
    return {"tokens_per_s": sum(q.max_tokens for q in requests) / wall_s, "elapsed_s": wall_s,
            "ttft_p50_s": summarize([r.ttft for r in done])["p50"],
            "tpot_p50_s": summarize([r.tpot for r in done if r.tpot is not None])["p50"],
            "texts": [r.text for r in done]}


def spec_counters(url: str) -> dict[str, float]:
    """The app's lifetime spec_decode counters from its /metrics (0 before its first draft)."""
    import httpx

    app = url.rstrip("/").rsplit("/", 1)[1]
    totals = dict.fromkeys(SPEC_COUNTERS, 0.0)
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        for key in SPEC_COUNTERS:
            if line.startswith(f"ray_rayllm_spec_decode_num_{key}_total{{") and f'application="{app}"' in line:
                totals[key] += float(line.rpartition(" ")[2])
    return totals


def wait_counters_settled(url: str, timeout_s: float = 30.0) -> dict[str, float]:
    """The counters once two reads 1.5 s apart agree (Ray publishes /metrics every few seconds at most)."""
    deadline = time.monotonic() + timeout_s
    counters = spec_counters(url)
    while time.monotonic() < deadline:
        time.sleep(1.5)
        counters, previous = spec_counters(url), counters
        if counters == previous:
            break
    return counters


def app_args(a: argparse.Namespace, variant: str) -> dict:
    args = {"model": str(a.model), "served_model_name": SERVED_NAME, "device": "cpu", "dtype": "float32",
            "max_num_seqs": max(a.concurrency), "seed": a.seed, **dict(a.serve_arg)}
    if variant == "spec":
        args["speculative_config"] = speculative_config(a)
    return args


def run_variant(url: str, a: argparse.Namespace, levels: list[tuple], count_drafts: bool) -> list[dict]:
    """Every level on one app: its figures, and (count_drafts: the app with speculation) the spec
    counters each level moved, read settled once before the first level and once after each."""
    warmup = WORKLOADS["copy"][0](2, a.seed + 999, a.vocab_limit, (16, 32), (8, 8))
    asyncio.run(run_level(url, warmup, 0.0, 2, a.seed, a.request_timeout))
    counters = wait_counters_settled(url) if count_drafts else dict.fromkeys(SPEC_COUNTERS, 0.0)
    out = []
    for workload, c, temperature, requests in levels:
        result = asyncio.run(run_level(url, requests, temperature, c, a.seed, a.request_timeout))
        now = wait_counters_settled(url) if count_drafts else counters
        result["counters"] = {k: now[k] - counters[k] for k in SPEC_COUNTERS}
        counters = now
        _progress(f"{workload} c={c}: {result['tokens_per_s']:.1f} tok/s")
        out.append(result)
    return out


def make_levels(a: argparse.Namespace) -> list[tuple]:
    levels = []
    for workload in a.workloads:
        make, temperature = WORKLOADS[workload]
        for c in a.concurrency:
            requests = make(a.num_requests, a.seed + c, a.vocab_limit, a.prompt_len, a.output_len)
            levels.append((workload, c, temperature, requests))
    return levels


def run_rounds(a: argparse.Namespace, levels: list[tuple]) -> list[dict]:
    """Each variant's app in turn on one local cluster, each going first in turn; one result per run."""
    from serve_app.local import deployed_app, local_cluster

    runs = []
    with local_cluster() as cluster_url:
        for rnd in range(a.rounds):
            for variant in (VARIANTS if rnd % 2 == 0 else VARIANTS[::-1]):
                _progress(f"round {rnd + 1}/{a.rounds}: {variant}")
                with deployed_app(cluster_url, app_args(a, variant), f"spec_{variant}") as url:
                    runs.append({"variant": variant, "round": rnd,
                                 "levels": run_variant(url, a, levels, count_drafts=variant == "spec")})
    return runs


def summarize_runs(runs: list[dict], levels: list[tuple]) -> list[dict]:
    """Per level: medians over rounds of each variant's figures, the speed-up, acceptance, mismatches."""
    rows = []
    for i, (workload, c, temperature, requests) in enumerate(levels):
        row = {"workload": workload, "concurrency": c, "temperature": temperature, "num_requests": len(requests)}
        for variant in VARIANTS:
            mine = [r["levels"][i] for r in runs if r["variant"] == variant]
            row[variant] = {k: statistics.median(m[k] for m in mine)
                            for k in ("tokens_per_s", "ttft_p50_s", "tpot_p50_s")}
        spec_runs = [r["levels"][i] for r in runs if r["variant"] == "spec"]
        row.update(_acceptance({k: sum(m["counters"][k] for m in spec_runs) / len(spec_runs) for k in SPEC_COUNTERS}))
        row["speedup"] = row["spec"]["tokens_per_s"] / row["baseline"]["tokens_per_s"]
        if temperature == 0:
            base = next(r["levels"][i]["texts"] for r in runs if r["variant"] == "baseline")
            row["greedy_mismatches"] = max(sum(x != y for x, y in zip(base, m["texts"])) for m in spec_runs)
        rows.append(row)
    return rows


def summary_table(rows: list[dict]) -> str:
    table = [[r["workload"], r["concurrency"], r["baseline"]["tokens_per_s"], r["spec"]["tokens_per_s"],
              f"x{r['speedup']:.2f}", 1e3 * r["baseline"]["ttft_p50_s"], 1e3 * r["spec"]["ttft_p50_s"],
              1e3 * r["baseline"]["tpot_p50_s"], 1e3 * r["spec"]["tpot_p50_s"], r["acceptance_rate"],
              r["mean_acceptance_length"], r.get("greedy_mismatches", "-")] for r in rows]
    return format_table(["workload", "conc", "base tok/s", "spec tok/s", "speed-up", "base TTFT p50 ms",
                         "spec TTFT p50 ms", "base TPOT p50 ms", "spec TPOT p50 ms", "acceptance rate",
                         "mean acceptance length", "greedy mismatches"], table)


def _progress(message: str) -> None:
    print(f"[loadtest spec] {message}", file=sys.stderr, flush=True)


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m loadtest --workload spec", description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True, help="a checkpoint dir (or a GGUF model dir)")
    ap.add_argument("--speculative", choices=("ngram", "draft"), default="ngram")
    add_speculation_args(ap)
    ap.add_argument("--concurrency", default="1,4,16", help="clients, comma-separated")
    ap.add_argument("--rounds", type=int, default=1, help="both apps this many times, each first in turn; medians")
    ap.add_argument("--serve-arg", type=_key_value, action="append", default=[], help="an app arg for both apps")
    ap.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request")
    ap.add_argument("--quick", action="store_true", help="a small workload for a smoke test")
    ap.add_argument("--out", type=Path, default=Path("bench_out/online_spec.json"))
    a = ap.parse_args(argv)
    try:
        a.concurrency = [int(c) for c in a.concurrency.split(",")]
    except ValueError:
        ap.error(f"--concurrency {a.concurrency!r}: expected comma-separated integers")
    a.workloads = a.workloads.split(",")
    if any(w not in WORKLOADS for w in a.workloads):
        ap.error(f"--workloads {','.join(a.workloads)!r}: choose from {', '.join(sorted(WORKLOADS))}")
    for name in ("num_requests", "rounds", "num_speculative_tokens"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')}={getattr(a, name)} must be >= 1")
    if min(a.concurrency) < 1:
        ap.error(f"--concurrency {a.concurrency}: every level must be >= 1")
    if a.speculative == "draft" and a.draft_model is None:
        ap.error("--speculative draft needs --draft-model")
    if not a.model.is_dir():
        ap.error(f"--model {str(a.model)!r} is not a checkpoint dir")
    a.prompt_len, a.output_len = ((32, 64), (16, 32)) if a.quick else ((64, 256), (64, 128))
    if a.quick:
        a.num_requests = min(a.num_requests, 4)
    return a


def main(argv: list[str], command: list[str] | None = None) -> dict:
    a = parse_args(argv)
    from engine.loader.model_path import resolve_model_path

    a.vocab_limit = prompt_id_limit(resolve_model_path(str(a.model)))
    levels = make_levels(a)
    runs = run_rounds(a, levels)
    rows = summarize_runs(runs, levels)
    for run in runs:  # the texts were for the comparison only
        for level in run["levels"]:
            del level["texts"]
    results = base_metadata(command or ["python", "-m", "loadtest", "--workload", "spec", *argv])
    results.update({"benchmark": "online_spec_cpu", "speculative_config": speculative_config(a),
                    "model": str(a.model), "prompt_len_range": list(a.prompt_len),
                    "output_len_range": list(a.output_len), "runs": runs, "results": rows})
    write_json(a.out, results)
    print(f"wrote {a.out}")
    print(summary_table(rows))
    return results
