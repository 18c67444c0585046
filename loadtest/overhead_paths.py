"""The three paths of loadtest.overhead: offline `LLM.generate`, in-process `AsyncLLM`, the Serve app."""
from __future__ import annotations

import asyncio
import os
import re
import time
from typing import Callable

from loadtest.proc_cpu import difference, snapshot
from loadtest.report import Stopwatch
from loadtest.stats import summarize
from loadtest.workload import BenchRequest

SERVED_NAME = "bench"


def _warmup(requests: list[BenchRequest]) -> list[BenchRequest]:
    """Two short requests of the same prompt length; their ids reversed, so the measured requests
    find nothing of theirs in the prefix cache."""
    return [BenchRequest(r.prompt_token_ids[::-1], min(r.max_tokens, 4)) for r in requests[:2]]


def _result(num_tokens: int, wall_s: float, cpu_s: float, **extra) -> dict:
    return {"num_tokens": num_tokens, "elapsed_s": wall_s, "tokens_per_s": num_tokens / wall_s, "cpu_s": cpu_s,
            "cpu_s_per_token_total": cpu_s / num_tokens, **extra}


def run_offline(kwargs: dict, requests: list[BenchRequest]) -> dict:
    import torch

    from engine import LLM
    from loadtest.ours import shutdown, timed_engine_run

    llm = LLM(**kwargs)
    try:
        watch, token_ids = timed_engine_run(llm, requests, _warmup(requests))
    finally:
        shutdown(llm)
    return _result(sum(len(t) for t in token_ids), watch.wall_s, watch.cpu_s, torch_threads=torch.get_num_threads())


# -- AsyncLLM in this process -----------------------------------------------------------
async def _async_one(llm, r: BenchRequest) -> tuple[float, float]:
    from engine import SamplingParams
    from engine.sampling_params import RequestOutputKind

    params = SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    start, ttft, num_tokens = time.perf_counter(), None, 0
    async for out in llm.generate({"prompt_token_ids": r.prompt_token_ids}, params):
        num_tokens += len(out.outputs[0].token_ids)
        if out.outputs[0].text and ttft is None:  # the first text, as the HTTP client times it
            ttft = time.perf_counter() - start
    if num_tokens != r.max_tokens:
        raise RuntimeError(f"AsyncLLM streamed {num_tokens} tokens, expected {r.max_tokens}")
    if ttft is None:
        raise RuntimeError("AsyncLLM streamed no text")
    return ttft, time.perf_counter() - start


async def _closed_loop(one, requests: list, concurrency: int) -> list:
    """`concurrency` workers, each sending its next request when the last one ends."""
    pending, results = iter(requests), []

    async def worker() -> None:
        for r in pending:
            results.append(await one(r))

    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(requests)))))
    return results


async def run_async(kwargs: dict, requests: list[BenchRequest], ttft_requests: list[BenchRequest],
                    concurrency: int) -> dict:
    from engine import AsyncLLM, EngineConfig

    llm = AsyncLLM(EngineConfig(**{k: v for k, v in kwargs.items() if v is not None}))
    try:
        await _closed_loop(lambda r: _async_one(llm, r), _warmup(requests), 1)
        return await async_level(llm, requests, ttft_requests, concurrency)
    finally:
        llm.shutdown()


async def async_level(llm, requests: list[BenchRequest], ttft_requests: list[BenchRequest], concurrency: int) -> dict:
    """A warm AsyncLLM measured: TTFT at concurrency 1 over `ttft_requests`, then `requests` at `concurrency`."""
    one = lambda r: _async_one(llm, r)  # noqa: E731
    ttfts = [t for t, _ in await _closed_loop(one, ttft_requests, 1)]
    step_cpu0 = llm.get_stats().get("step_thread_cpu_s", 0.0)
    with Stopwatch() as watch:
        timings = await _closed_loop(one, requests, concurrency)
    step_cpu = llm.get_stats().get("step_thread_cpu_s", 0.0) - step_cpu0
    num_tokens = sum(r.max_tokens for r in requests)
    return _result(num_tokens, watch.wall_s, watch.cpu_s, ttft_c1_p50_ms=summarize(ttfts)["p50"] * 1e3,
                   ttft_s=summarize([t for t, _ in timings]), e2e_s=summarize([e for _, e in timings]),
                   step_thread_cpu_s=step_cpu)


# -- the Serve app over HTTP ---------------------------------------------------------------
# The Ingress's exact per-hop counters (its histogram's _sum is approximate under Ray's export).
_COUNTER_LINE = re.compile(r'^\w+_stream_(messages|tokens)_total\{[^}]*hop="(\w+)"[^}]*\}\s+([0-9.e+-]+)$')
_KEYS = {"messages": "count", "tokens": "sum"}


def chunk_counters(metrics_text: str) -> dict[str, dict[str, float]]:
    """{hop: {"count": messages, "sum": tokens}} from a Prometheus scrape of the Ingress."""
    out: dict[str, dict[str, float]] = {}
    for line in metrics_text.splitlines():
        m = _COUNTER_LINE.match(line)
        if m:
            hop, key = out.setdefault(m.group(2), {}), _KEYS[m.group(1)]  # summed over the Ingress replicas
            hop[key] = hop.get(key, 0.0) + float(m.group(3))
    return out


def messages_per_token(before: dict, after: dict) -> dict[str, float]:
    rates = {}
    for hop, now in after.items():
        prev = before.get(hop, {})
        tokens = now.get("sum", 0.0) - prev.get("sum", 0.0)
        if tokens > 0:
            rates[hop] = (now.get("count", 0.0) - prev.get("count", 0.0)) / tokens
    return rates


async def _http_level(client, url: str, requests: list[BenchRequest], concurrency: int) -> list:
    from loadtest.client import Target, build_payload, send_request

    target = Target(url=url + "/v1/completions", endpoint="completions", headers={}, timeout_s=600.0)

    async def one(r: BenchRequest):
        record = await send_request(client, target, build_payload(SERVED_NAME, r.prompt_token_ids, r.max_tokens,
                                                                  "completions"))
        if not record.ok or record.output_tokens != r.max_tokens:
            raise RuntimeError(f"served request failed: {record.error or record.output_tokens}")
        return record

    return await _closed_loop(one, requests, concurrency)


async def _engine_stats() -> dict:
    from serve_app.local import APP_NAME, call_deployment, engine_deployment

    return await asyncio.to_thread(lambda: call_deployment(APP_NAME, engine_deployment(), "get_stats"))


async def _scrape(client, url: str) -> dict[str, dict[str, float]]:
    async with client.get(url + "/metrics") as response:
        return chunk_counters(await response.text())


def split_engine_cpu(cpu: dict[str, float], stats0: dict, stats: dict) -> dict[str, float]:
    """Per-role CPU seconds with the engine's step thread (from the replica's stats, before and
    after) split out of the process it runs in."""
    step_cpu = stats.get("step_thread_cpu_s", 0.0) - stats0.get("step_thread_cpu_s", 0.0)
    engine = "engine_core" if "engine_core" in cpu else "engine_replica"  # the process the step loop runs in
    return cpu | {"engine_step_thread": step_cpu, engine: max(cpu.get(engine, 0.0) - step_cpu, 0.0)}


async def _serve_levels(url: str, requests, ttft_requests, concurrency: int, metrics_interval_s: float) -> dict:
    from loadtest.client import open_session

    async with open_session(concurrency + 4, timeout_s=600.0) as client:
        await _http_level(client, url, _warmup(requests), 1)
        ttfts = [r.ttft for r in await _http_level(client, url, ttft_requests, 1)]
        # /metrics is Ray's export, published every metrics_interval_s: wait for the requests so far.
        await asyncio.sleep(2.5 * metrics_interval_s)
        chunks0, cpu0, stats0 = await _scrape(client, url), snapshot(os.getpid()), await _engine_stats()
        start = time.perf_counter()
        records = await _http_level(client, url, requests, concurrency)
        wall = time.perf_counter() - start
        cpu, stats = difference(cpu0, snapshot(os.getpid())), await _engine_stats()
        await asyncio.sleep(2.5 * metrics_interval_s)
        chunks = await _scrape(client, url)
    cpu = split_engine_cpu(cpu, stats0, stats)
    num_tokens = sum(r.output_tokens for r in records)
    return _result(num_tokens, wall, sum(cpu.values()), ttft_c1_p50_ms=summarize(ttfts)["p50"] * 1e3,
                   ttft_s=summarize([r.ttft for r in records]), e2e_s=summarize([r.e2e for r in records]),
                   itl_s=summarize([g for r in records for g in r.itls]), cpu_s_by_role=cpu,
                   messages_per_token=messages_per_token(chunks0, chunks))


def run_serve(kwargs: dict, workload: Callable[[int], tuple[list, list]], concurrency: int,
              extra_args: dict, sweep: tuple[str, list] | None = None,
              high_throughput: bool = True, metrics_interval_ms: int | None = None) -> dict[str, dict]:
    """{path name: result}: "serve", or one "serve_KEY=V" per value of a sweep (KEY, [V, ...]) over
    the engine replica's user_config (StreamingConfig), all on one running app.

    Each value is applied with the EngineDeployment's reconfigure() (what a user_config change
    does), over the app's own streaming args, so a sweep pays for one cluster and one model load. Sweep point k runs
    `workload(k)`: the same shape, fresh prompts, because the app's prefix cache still holds
    the previous point's (reusing them made later points skip their prefill: 1.3x offline).
    high_throughput=False: behind Serve's Python proxy instead of HAProxy (names end in "_pyproxy").
    metrics_interval_ms: Ray's metrics publishing interval; None: Ray's own, as `serve run` has it.
    """
    from serve_app.args import StreamingConfig
    from serve_app.local import APP_NAME, RAY_METRICS_REPORT_INTERVAL_MS, local_server, reconfigure_engine

    args = {k: v for k, v in kwargs.items() if v is not None} | {"served_model_name": SERVED_NAME} | extra_args
    streaming = {k: v for k, v in args.items() if k in StreamingConfig.model_fields}
    key, values = sweep or (None, [None])
    results = {}
    suffix = "" if high_throughput else "_pyproxy"
    # By default Ray's own metrics interval, as `serve run` has it: the benchmark measures what users run.
    interval_ms = metrics_interval_ms or RAY_METRICS_REPORT_INTERVAL_MS
    with local_server(args, high_throughput=high_throughput, metrics_report_interval_ms=interval_ms) as url:
        for k, value in enumerate(values):
            requests, ttft_requests = workload(k)
            name, point = "serve" + suffix, {}
            if key is not None:
                point = {key: value}
                reconfigure_engine(APP_NAME, streaming | point)
                name = f"serve_{key}={_fmt(value)}{suffix}"
            results[name] = asyncio.run(_serve_levels(url, requests, ttft_requests, concurrency,
                                                      interval_ms / 1000))
            results[name]["app_args"] = args | point
    return results


def _fmt(value) -> str:
    try:
        return f"{float(value):g}"
    except (TypeError, ValueError):
        return str(value)
