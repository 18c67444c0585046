"""loadtest.autoscale: under an open-loop load, Serve brings up the second engine replica and both serve.

Real Ray Serve (local cluster), the tiny model, the demo's aggressive autoscaler delays.
"""
import asyncio

import pytest

from loadtest.autoscale import DEMO_ARGS, Sampler, tokens_by_replica
from loadtest.online import OnlineConfig, run_sweep
from serve_app.local import local_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_tokens_by_replica_sums_each_replicas_series():
    text = ('ray_rayllm_generation_tokens_total{WorkerId="a",replica="r1"} 10.0\n'
            'ray_rayllm_generation_tokens_total{WorkerId="b",replica="r2"} 5.0\n'
            'ray_rayllm_prompt_tokens_total{replica="r1"} 99.0\n')
    assert tokens_by_replica(text) == {"r1": 10.0, "r2": 5.0}


def test_second_engine_replica_comes_up_under_load_and_serves(tiny_llama, tmp_path):
    with local_server({"model": tiny_llama, **DEMO_ARGS}, num_cpus=2) as url, Sampler(url, period_s=0.5) as sampler:
        assert sampler.sample()["running"] == 1  # min_replicas
        # 25 s of arrivals: long enough for the second replica to start (its engine process imports
        # torch and loads the model, on two busy cores) and then take traffic.
        cfg = OnlineConfig(base_url=url, model="tiny", concurrency=[1], num_prompts=400, input_len=32,
                           output_len=64, out_dir=tmp_path, request_rates=[16.0], num_warmup=0, token_ids=True)
        (level,) = asyncio.run(run_sweep(cfg))["levels"]
        both = sampler.wait_for(lambda s: sum(v > 0 for v in s["tokens_by_replica"].values()) >= 2, timeout_s=15)
    assert level["num_errors"] == 0, level["errors"]
    assert max(s["running"] for s in sampler.samples) == 2, [s["replica_states"] for s in sampler.samples]
    assert both, f"traffic reached one replica only: {sampler.samples[-1]['tokens_by_replica']}"
