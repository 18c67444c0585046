"""engine/core/stats.py: what the engine reports per step and per finished request (the served metrics read it)."""
import pytest

from engine import LLM, SamplingParams
from engine.outputs import RequestMetrics
from engine.core.stats import StatsLog

ENGINE = dict(device="cpu", dtype="float32", max_model_len=256, num_kv_blocks=64, max_num_seqs=8, seed=0)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    llm = LLM(model=tiny_llama, **ENGINE)
    yield llm
    llm.llm_engine.shutdown()


def test_off_by_default_so_offline_runs_keep_nothing(llm):
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=4, ignore_eos=True))
    assert llm.llm_engine.stats_log.take().is_empty


def test_steps_tokens_and_finished_requests(llm):
    log = llm.llm_engine.stats_log
    log.enabled = True
    try:
        prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (10, 20)]
        llm.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
        stats = log.take()
    finally:
        log.enabled = False
    # Every prompt token and every generated token but the last of each request is computed once.
    assert sum(stats.iteration_tokens) == 10 + 20 + 2 * (6 - 1)
    assert stats.num_prompt_tokens == 30 and stats.num_generation_tokens == 12
    assert len(stats.time_to_first_tokens) == 2
    assert len(stats.inter_token_latencies) == 2 * 5  # one per request and decode step
    done = sorted(stats.finished_requests, key=lambda r: r.num_prompt_tokens)
    assert [(r.finish_reason, r.num_prompt_tokens, r.num_generation_tokens) for r in done] == \
        [("length", 10, 6), ("length", 20, 6)]
    for r in done:
        assert r.queued_time >= 0 and r.prefill_time >= 0 and r.decode_time > 0
        assert r.e2e_latency == pytest.approx(r.queued_time + r.inference_time, abs=1e-3)
        assert r.time_per_output_token == pytest.approx(r.decode_time / 5)
    assert log.take().is_empty  # taken once


def test_abort_counts_as_finished_with_reason_abort():
    log = StatsLog()
    log.enabled = True
    m = RequestMetrics(arrival_time=10.0)
    log.on_finished(m, "abort", num_prompt_tokens=7, num_tokens=[0], now=12.5)
    (r,) = log.take().finished_requests
    assert (r.finish_reason, r.e2e_latency, r.queued_time, r.time_per_output_token) == ("abort", 2.5, 2.5, None)
