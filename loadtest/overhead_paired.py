"""loadtest.overhead --paired N: offline, AsyncLLM and the served app in alternation, round by round.

Why: a shared machine's speed can drift within seconds, from the host rather than its own
processes (docs/benchmarks.md, ninth session, "Why paired rounds"). A ratio of two paths timed
minutes apart carries that drift whole. Here every
path runs once a round, each round on fresh prompts, the paths' order rotating from round to
round, all on one served app and one offline and one in-process engine, so each round's
ratios compare runs seconds apart, and the median over rounds is the figure.

Fairness: while the offline and `AsyncLLM` paths run, every process of the served app's
cluster (Ray's daemons, the replicas, the engine replica's engine process, HAProxy) is
stopped with SIGSTOP and continued after, so those paths have the box as they would alone,
save this process's own idle Ray driver threads. The served path runs with everything it needs.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from pathlib import Path
from typing import Callable, Iterator

from loadtest.overhead_paths import (SERVED_NAME, _async_one, _closed_loop, _engine_stats, _http_level, _result,
                                     _warmup, async_level, split_engine_cpu)
from loadtest.proc_cpu import cmdline, difference, parent_pid, role_of, snapshot
from loadtest.report import Stopwatch
from loadtest.stats import summarize

ORDERS = (("offline", "async", "serve"), ("serve", "offline", "async"), ("async", "serve", "offline"))


def cluster_pids(own_pid: int) -> list[int]:
    """The served app's processes: every descendant of this process (the local cluster it started)
    and its HAProxy, which runs daemonized, outside that tree (found by the state directory that
    serve_app.local gave this cluster's HAProxy, in its config path; any HAProxy if none was
    given). Another cluster on the box (the test suite runs one beside this) is left alone."""
    pids = [int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit()]
    children: dict[int, list[int]] = {}
    for pid in pids:
        children.setdefault(parent_pid(pid), []).append(pid)
    state_dir = os.environ.get("RAY_SERVE_HAPROXY_SERVER_STATE_BASE", "")
    found = {pid for pid in pids if role_of(cmdline(pid)) == "haproxy" and state_dir in cmdline(pid)}
    stack = [own_pid]
    while stack:
        for child in children.get(stack.pop(), ()):
            found.add(child)
            stack.append(child)
    found.discard(own_pid)
    return sorted(found)


@contextlib.contextmanager
def frozen(pids: list[int]) -> Iterator[None]:
    """SIGSTOP the processes for the block, SIGCONT them after, however it ends."""
    stopped = []
    try:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
                stopped.append(pid)
        yield
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def _offline(llm, requests) -> dict:
    from loadtest.ours import engine_generate

    with Stopwatch() as watch:
        token_ids = engine_generate(llm, requests)
    return _result(sum(len(t) for t in token_ids), watch.wall_s, watch.cpu_s)


async def _serve(client, url: str, requests, ttft_requests, concurrency: int) -> dict:
    ttfts = [r.ttft for r in await _http_level(client, url, ttft_requests, 1)]
    cpu0, stats0 = snapshot(os.getpid()), await _engine_stats()
    start = time.perf_counter()
    records = await _http_level(client, url, requests, concurrency)
    wall = time.perf_counter() - start
    cpu = split_engine_cpu(difference(cpu0, snapshot(os.getpid())), stats0, await _engine_stats())
    return _result(sum(r.output_tokens for r in records), wall, sum(cpu.values()),
                   ttft_c1_p50_ms=summarize(ttfts)["p50"] * 1e3, cpu_s_by_role=cpu, messages_per_token={})


def run_paired(kwargs: dict, workload: Callable[[int], tuple[list, list]], concurrency: int, extra_args: dict,
               rounds: int, metrics_interval_ms: int | None = None, progress: Callable[[str], None] = print) -> list:
    """[{path: result} per round]: offline, async and serve once a round, in rotating order."""
    from serve_app.local import RAY_METRICS_REPORT_INTERVAL_MS, local_server

    args = {k: v for k, v in kwargs.items() if v is not None} | {"served_model_name": SERVED_NAME} | extra_args
    with local_server(args, metrics_report_interval_ms=metrics_interval_ms or RAY_METRICS_REPORT_INTERVAL_MS) as url:
        return asyncio.run(_rounds(kwargs, url, workload, concurrency, rounds, progress))


async def _rounds(kwargs, url, workload, concurrency: int, rounds: int, progress) -> list:
    from engine import LLM, AsyncLLM, EngineConfig
    from loadtest.client import open_session
    from loadtest.ours import engine_generate, shutdown

    config = {k: v for k, v in kwargs.items() if v is not None}
    out = []
    with contextlib.ExitStack() as engines:  # both shut down however this ends, the first if the second fails
        llm = LLM(**config)
        engines.callback(shutdown, llm)
        async_llm = AsyncLLM(EngineConfig(**config))
        engines.callback(async_llm.shutdown)
        async with open_session(concurrency + 4, timeout_s=600.0) as client:
            requests, _ = workload(0)
            warm = _warmup(requests)
            engine_generate(llm, warm)
            await _closed_loop(lambda r: _async_one(async_llm, r), warm, 1)
            await _http_level(client, url, warm, 1)
            for k in range(rounds):
                requests, ttft_requests = workload(k + 1)  # fresh prompts: no prefix-cache hits across rounds
                results = {}
                for path in ORDERS[k % len(ORDERS)]:
                    if path == "serve":
                        results[path] = await _serve(client, url, requests, ttft_requests, concurrency)
                    else:
                        with frozen(cluster_pids(os.getpid())):
                            results[path] = _offline(llm, requests) if path == "offline" else \
                                await async_level(async_llm, requests, ttft_requests, concurrency)
                    progress(f"round {k + 1}: {path}: {results[path]['tokens_per_s']:.0f} tok/s")
                out.append({p: results[p] for p in ("offline", "async", "serve")})
    return out
