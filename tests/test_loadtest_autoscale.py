"""loadtest.autoscale: under load, Serve brings up the second engine replica and both serve.

Real Ray Serve (the suite's shared local cluster), the tiny model, the demo's aggressive autoscaler delays.
"""
import asyncio
import contextlib

import pytest

from loadtest.autoscale import DEMO_ARGS, Sampler, tokens_by_replica
from loadtest.online import OnlineConfig, run_sweep
from serve_app.local import deployed_app

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

APP = "test_loadtest_autoscale"
# Requests kept in flight: three replicas' worth at the autoscaler's target (max_num_seqs ongoing
# requests each), so the one replica is over its target whatever this box's speed, and Serve wants
# the second (max_replicas) as soon as its delays allow.
CONCURRENCY = 3 * DEMO_ARGS["max_num_seqs"]
# Requests planned: far more than are sent before the second replica serves on any box; the load
# stops as soon as both replicas have served.
NUM_PROMPTS = 100 * CONCURRENCY


def _served_by_two(before: dict):
    """Whether a sample shows two replicas that generated tokens since `before` (a sample too:
    the series of replicas stopped earlier linger in the export)."""
    return lambda sample: sum(v > before["tokens_by_replica"].get(r, 0.0)
                              for r, v in sample["tokens_by_replica"].items()) >= 2


async def _load_until(cfg: OnlineConfig, sampler: Sampler, both_served) -> dict | None:
    """The sweep until the sampler sees both replicas serve (None: stopped then), or its end."""
    sweep = asyncio.ensure_future(run_sweep(cfg))
    while not sweep.done() and not (sampler.samples and both_served(sampler.samples[-1])):
        await asyncio.sleep(sampler.period_s)
    if sweep.done():
        return sweep.result()["levels"][0]
    sweep.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await sweep
    return None


def test_tokens_by_replica_sums_each_replicas_series():
    text = ('ray_rayllm_generation_tokens_total{WorkerId="a",application="app",replica="r1"} 10.0\n'
            'ray_rayllm_generation_tokens_total{WorkerId="c",application="app",replica="r1"} 1.0\n'
            'ray_rayllm_generation_tokens_total{WorkerId="b",replica="r2",application="app"} 5.0\n'
            'ray_rayllm_generation_tokens_total{WorkerId="d",application="other",replica="r3"} 7.0\n'
            'ray_rayllm_prompt_tokens_total{application="app",replica="r1"} 99.0\n')
    assert tokens_by_replica(text) == {"r1": 11.0, "r2": 5.0, "r3": 7.0}
    assert tokens_by_replica(text, "app") == {"r1": 11.0, "r2": 5.0}  # another app's replicas are not ours


def test_second_engine_replica_comes_up_under_load_and_serves(ray_cluster, tiny_llama, tmp_path):
    # engine_process=False: the second replica starts without a second process importing torch.
    with deployed_app(ray_cluster, {"model": tiny_llama, **DEMO_ARGS, "engine_process": False}, APP) as url, \
            Sampler(url, APP, period_s=0.5) as sampler:
        before = sampler.sample()
        assert before["running"] == 1  # min_replicas
        both_served = _served_by_two(before)
        cfg = OnlineConfig(base_url=url, model="tiny", input_len=32, output_len=64, out_dir=tmp_path, token_ids=True,
                           concurrency=[CONCURRENCY], num_prompts=NUM_PROMPTS, num_warmup=0)
        level = asyncio.run(_load_until(cfg, sampler, both_served))
        both = sampler.wait_for(both_served, timeout_s=15)
    assert level is None or level["num_errors"] == 0, level["errors"]
    assert max(s["running"] for s in sampler.samples) == 2, [s["replica_states"] for s in sampler.samples]
    assert both, f"traffic reached one replica only: {sampler.samples[-1]['tokens_by_replica']}"
