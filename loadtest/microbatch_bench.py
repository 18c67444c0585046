"""Micro-batching on vs off, same load, same app: what the Ingress's @serve.batch buys.

    python -m loadtest.microbatch_bench --model models/tiny-llama --concurrency 32 --num-requests 256

Starts the app once, then alternates the Ingress between max_batch_size=1 (off) and the
batching config (on) through reconfigure(), `--rounds` times each, so both modes see the
same machine state. Each round sends `num-requests` streaming chat requests with at most
`concurrency` in flight. Prints a table last; `--out FILE` writes every number as JSON.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import httpx

from serve_app.local import APP_NAME, METRICS_REPORT_INTERVAL_MS, local_server, reconfigure_ingress

WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau "
         "upsilon phi chi psi omega").split()


def _messages(i: int, words: int) -> list[dict]:
    text = " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(words))
    return [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": text}]


async def _one(client: httpx.AsyncClient, model: str, i: int, a) -> dict:
    body = {"model": model, "messages": _messages(i, a.prompt_words), "max_tokens": a.output_len, "stream": True,
            "temperature": 0, "ignore_eos": True}
    start = time.perf_counter()
    ttft = None
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            return {"ok": False}
        async for line in r.aiter_lines():
            if ttft is None and line.startswith("data: {") and '"content":"' in line and '"content":""' not in line:
                ttft = time.perf_counter() - start
    return {"ok": True, "ttft": ttft or 0.0, "e2e": time.perf_counter() - start}


async def _round(url: str, model: str, a) -> dict:
    sem = asyncio.Semaphore(a.concurrency)

    async def bounded(client, i):
        async with sem:
            return await _one(client, model, i, a)

    limits = httpx.Limits(max_connections=a.concurrency + 8, max_keepalive_connections=a.concurrency + 8)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(bounded(client, i) for i in range(a.num_requests)))
        wall = time.perf_counter() - start
    ok = [r for r in results if r["ok"]]
    ttfts, e2es = sorted(r["ttft"] for r in ok), sorted(r["e2e"] for r in ok)
    return {"requests_per_s": len(ok) / wall, "errors": len(results) - len(ok), "wall_s": wall,
            "ttft_p50_ms": 1000 * statistics.median(ttfts), "ttft_p90_ms": 1000 * ttfts[int(0.9 * (len(ttfts) - 1))],
            "e2e_p50_ms": 1000 * statistics.median(e2es), "e2e_p90_ms": 1000 * e2es[int(0.9 * (len(e2es) - 1))]}


def _summary(rounds: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/tiny-llama")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--prompt-words", type=int, default=64)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-batch-size", type=int, default=8)
    p.add_argument("--batch-wait-timeout-s", type=float, default=0.002)  # "on-nowait" runs it with 0
    p.add_argument("--out", default=None)
    a = p.parse_args()
    on = {"max_batch_size": a.max_batch_size, "batch_wait_timeout_s": a.batch_wait_timeout_s}
    modes = {"off": {"max_batch_size": 1, "batch_wait_timeout_s": 0.0}, "on": on,
             "on-nowait": {**on, "batch_wait_timeout_s": 0.0}}
    args = {"model": a.model, "served_model_name": "bench", "device": "cpu", "dtype": "float32",
            "max_model_len": 2048, "max_num_seqs": max(64, a.concurrency), **on}
    results: dict[str, list[dict]] = {mode: [] for mode in modes}
    with local_server(args) as url:
        asyncio.run(_round(url, "bench", argparse.Namespace(**{**vars(a), "num_requests": a.concurrency})))  # warm-up
        for _ in range(a.rounds):
            for mode, cfg in modes.items():
                reconfigure_ingress(APP_NAME, cfg)
                before = _batch_stats(url)
                results[mode].append(_round_sync(url, a))
                after = _batch_stats(url)
                results[mode][-1]["mean_batch_size"] = (after[1] - before[1]) / max(after[0] - before[0], 1)
    summary = {mode: _summary(rs) for mode, rs in results.items()}
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"args": vars(a), "rounds": results, "median": summary}, f, indent=2)
    print(f"\nmicro-batching, {a.num_requests} streaming chat requests x {a.rounds} rounds, "
          f"concurrency {a.concurrency}, ~{a.prompt_words} words in, {a.output_len} tokens out (medians)")
    keys = list(summary["on"])
    print(f"{'mode':14}" + "".join(f"{k:>16}" for k in keys))
    for mode in modes:
        print(f"{mode:14}" + "".join(f"{summary[mode][k]:>16.2f}" for k in keys))
    for mode in ("on", "on-nowait"):
        print(f"{mode + '/off':14}" + "".join(f"{summary[mode][k] / summary['off'][k]:>16.2f}" if summary["off"][k]
                                             else f"{'-':>16}" for k in keys))


def _batch_stats(url: str) -> tuple[float, float]:
    """(number of micro-batches, requests in them) so far, over the Ingress replicas, from /metrics.

    /metrics is Ray's metrics export (published every METRICS_REPORT_INTERVAL_MS): wait that out first."""
    time.sleep(2.5 * METRICS_REPORT_INTERVAL_MS / 1000)
    text = httpx.get(url + "/metrics", timeout=30).text
    values = {}
    for line in text.splitlines():
        for key in ("ray_rayllm_ingress_batches_total", "ray_rayllm_ingress_batched_requests_total"):
            if line.startswith(key):
                values[key] = values.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return (values.get("ray_rayllm_ingress_batches_total", 0.0),
            values.get("ray_rayllm_ingress_batched_requests_total", 0.0))


def _round_sync(url: str, a) -> dict:
    return asyncio.run(_round(url, "bench", a))


if __name__ == "__main__":
    main()
