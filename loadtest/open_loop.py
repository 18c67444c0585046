"""Open-loop load: requests arrive at a rate (Poisson), whether or not earlier ones have finished.

Closed loop (loadtest.online, `--concurrency`) measures what c patient clients get; open loop
(`--request-rate`) measures what a server does when users keep arriving regardless, which is
what production traffic and an autoscaler see: beyond its capacity the queue, and the
latency, grow without bound instead of the clients slowing down.

Inter-arrival gaps are exponential with mean 1 / rate (seeded, so a run repeats exactly);
`rate=inf` sends everything at once. `max_concurrency` optionally caps requests in flight
(as vLLM's benchmark does): arrivals beyond it wait for a slot, on the client.
"""
from __future__ import annotations

import asyncio
import math
import random
import time

import aiohttp

from loadtest.client import RequestRecord, build_payload, send_request


def arrival_offsets(num: int, rate: float, seed: int) -> list[float]:
    """Seconds from the level's start at which each of `num` requests is sent."""
    if not rate > 0:
        raise ValueError(f"request rate {rate} must be > 0 (inf: all at once)")
    if math.isinf(rate):
        return [0.0] * num
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(num):
        out.append(t)
        t += rng.expovariate(rate)
    return out


async def run_rate_level(client: aiohttp.ClientSession, cfg, rate: float, level_index: int) -> dict:
    """`cfg.num_prompts` requests with Poisson arrivals at `rate`/s; the level's summary and timeline."""
    from loadtest.online import summarize_level

    target = cfg.target()
    seed = cfg.seed * 100_003 + 7_919 * (level_index + 1)
    prompts = cfg.prompts(seed=seed, num=cfg.num_prompts)
    offsets = arrival_offsets(len(prompts), rate, seed)
    slots = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    start = time.perf_counter()

    async def one(prompt, offset: float) -> tuple[float, RequestRecord]:
        await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
        payload = build_payload(cfg.model, prompt, cfg.output_len, cfg.endpoint)
        if slots is None:
            sent = time.perf_counter() - start
            return sent, await send_request(client, target, payload)
        async with slots:
            sent = time.perf_counter() - start
            return sent, await send_request(client, target, payload)

    done = await asyncio.gather(*(one(p, o) for p, o in zip(prompts, offsets)))
    duration = time.perf_counter() - start
    level = summarize_level([r for _, r in done], duration, request_rate=rate,
                            max_concurrency=cfg.max_concurrency)
    # Per request: when it was sent (s from the level's start), and what it got: for plots over time.
    level["timeline"] = [{"sent_s": round(sent, 4), "ok": r.ok, "ttft_s": r.ttft, "e2e_s": r.e2e,
                          "output_tokens": r.output_tokens} for sent, r in done]
    return level
