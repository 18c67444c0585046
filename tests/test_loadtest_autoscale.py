"""loadtest.autoscale: under an open-loop load, Serve brings up the second engine replica and both serve.

Real Ray Serve (the suite's shared local cluster), the tiny model, the demo's aggressive autoscaler delays.
"""
import asyncio
import itertools
import random
import time

import pytest

from loadtest.autoscale import DEMO_ARGS, Sampler, tokens_by_replica
from loadtest.client import RequestRecord, build_payload, open_session, send_request
from loadtest.online import OnlineConfig, run_sweep
from serve_app.local import deployed_app

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

APP = "test_loadtest_autoscale"
MAX_LOAD_S = 300.0  # of arrivals at most; the load stops as soon as both replicas have served
RAMP_S = 15.0  # the arrival rate grows 1.5x each time this passes without a second replica serving


def test_tokens_by_replica_sums_each_replicas_series():
    text = ('ray_rayllm_generation_tokens_total{WorkerId="a",replica="r1"} 10.0\n'
            'ray_rayllm_generation_tokens_total{WorkerId="b",replica="r2"} 5.0\n'
            'ray_rayllm_prompt_tokens_total{replica="r1"} 99.0\n')
    assert tokens_by_replica(text) == {"r1": 10.0, "r2": 5.0}


def test_second_engine_replica_comes_up_under_load_and_serves(ray_cluster, tiny_llama, tmp_path):
    with deployed_app(ray_cluster, {"model": tiny_llama, **DEMO_ARGS}, APP) as url, \
            Sampler(url, APP, period_s=0.5) as sampler:
        assert sampler.sample()["running"] == 1  # min_replicas
        common = dict(base_url=url, model="tiny", input_len=32, output_len=64, out_dir=tmp_path, token_ids=True)
        # The one replica's capacity on this box now: a full batch (max_num_seqs) kept busy.
        batch = DEMO_ARGS["max_num_seqs"]
        (full,) = asyncio.run(run_sweep(OnlineConfig(concurrency=[batch], num_prompts=2 * batch, **common)))["levels"]
        # Twice that arrives, and more as long as one replica copes (the box's speed may change:
        # the suite runs other tests beside this one), until both replicas have served tokens (the
        # second one starts: import torch, load): no fixed load to outgrow.
        records = asyncio.run(_load_until(OnlineConfig(concurrency=[1], num_prompts=1, **common),
                                          rate=2 * full["request_throughput"],
                                          done=lambda: _both_served(sampler.samples[-1])))
    assert full["num_errors"] == 0, full["errors"]
    assert records and all(r.ok for r in records), [r.error for r in records if not r.ok][:3]
    assert max(s["running"] for s in sampler.samples) == 2, [s["replica_states"] for s in sampler.samples]
    assert _both_served(sampler.samples[-1]), \
        f"traffic reached one replica only: {sampler.samples[-1]['tokens_by_replica']}"


def _both_served(sample: dict) -> bool:
    return sum(v > 0 for v in sample["tokens_by_replica"].values()) >= 2


async def _load_until(cfg: OnlineConfig, rate: float, done, max_s: float = MAX_LOAD_S) -> list[RequestRecord]:
    """Poisson arrivals from `rate`, 1.5x faster every RAMP_S, until `done()` (a cheap check of the
    sampler's last sample) or `max_s`; then every request sent is awaited. Their records."""
    rng, target = random.Random(0), cfg.target()
    prompts = itertools.cycle(cfg.prompts(seed=1, num=64))
    async with open_session(max_connections=1000, timeout_s=cfg.request_timeout) as client:
        sent: list[asyncio.Task] = []
        start = time.monotonic()
        while not done() and time.monotonic() - start < max_s:
            payload = build_payload(cfg.model, next(prompts), cfg.output_len, cfg.endpoint)
            sent.append(asyncio.create_task(send_request(client, target, payload)))
            ramp = 1.5 ** ((time.monotonic() - start) // RAMP_S)
            await asyncio.sleep(rng.expovariate(rate * ramp))
        return list(await asyncio.gather(*sent))
