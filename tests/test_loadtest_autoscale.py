"""loadtest.autoscale: under an open-loop load, Serve brings up the second engine replica and both serve.

Real Ray Serve (the suite's shared local cluster), the tiny model, the demo's aggressive autoscaler delays.
"""
import asyncio
import contextlib
import math

import pytest

from loadtest.autoscale import DEMO_ARGS, Sampler, tokens_by_replica
from loadtest.online import OnlineConfig, run_sweep
from serve_app.local import deployed_app

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

APP = "test_loadtest_autoscale"
# Arrivals planned for at most this long: on any box, longer than the second replica takes to start
# (import torch, load) and take traffic; the load stops as soon as both replicas have served.
LOAD_S = 60.0


def _both_served(sample: dict) -> bool:
    return sum(v > 0 for v in sample["tokens_by_replica"].values()) >= 2


async def _load_until(cfg: OnlineConfig, sampler: Sampler) -> dict | None:
    """The open-loop sweep until the sampler sees both replicas serve (None: stopped then), or its end."""
    sweep = asyncio.ensure_future(run_sweep(cfg))
    while not sweep.done() and not (sampler.samples and _both_served(sampler.samples[-1])):
        await asyncio.sleep(sampler.period_s)
    if sweep.done():
        return sweep.result()["levels"][0]
    sweep.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await sweep
    return None


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
        # Twice that arrives: the queue grows, whatever this box's speed, until a second replica serves.
        rate = 2 * full["request_throughput"]
        cfg = OnlineConfig(concurrency=[1], num_prompts=math.ceil(rate * LOAD_S), request_rates=[rate], num_warmup=0,
                           **common)
        level = asyncio.run(_load_until(cfg, sampler))
        both = sampler.wait_for(_both_served, timeout_s=15)
    assert full["num_errors"] == 0, full["errors"]
    assert level is None or level["num_errors"] == 0, level["errors"]
    assert max(s["running"] for s in sampler.samples) == 2, [s["replica_states"] for s in sampler.samples]
    assert both, f"traffic reached one replica only: {sampler.samples[-1]['tokens_by_replica']}"
