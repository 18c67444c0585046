"""serve_app/metrics.py without Ray: what each replica records (through an in-memory factory)."""
from engine.core.stats import FinishedRequestStats, IterationStats
from serve_app.metrics import EngineMetrics, IngressMetrics, build_1_2_5_buckets
from tests.fake_metrics import Recorder


def _finished(reason="stop", tpot=0.01):
    return FinishedRequestStats(finish_reason=reason, e2e_latency=1.0, queued_time=0.2, prefill_time=0.1,
                                decode_time=0.7, inference_time=0.8, num_prompt_tokens=12,
                                num_generation_tokens=71, time_per_output_token=tpot)


def test_engine_series_have_vllm_names_and_meanings():
    rec = Recorder()
    m = EngineMetrics("rayllm", "tiny", max_model_len=2048, factory=rec)
    stats = {"num_requests_running": 3, "num_requests_waiting": 1, "kv_cache_usage": 0.25,
             "prefix_cache_queries": 100, "prefix_cache_hits": 40, "num_preemptions": 2,
             "host_kv_cache_usage": 0.5, "prefix_cache_host_hits": 16, "kv_offload_blocks_out": 3,
             "kv_offload_blocks_in": 1}
    it = IterationStats(num_prompt_tokens=12, num_generation_tokens=5, iteration_tokens=[12, 1, 1],
                        time_to_first_tokens=[0.3], inter_token_latencies=[0.01, 0.02],
                        finished_requests=[_finished(), _finished("abort", None)])
    m.record(stats, [it])
    m.record({**stats, "prefix_cache_queries": 150, "prefix_cache_hits": 40}, [])  # lifetime -> increments
    assert rec.value("rayllm_num_requests_running", model_name="tiny") == 3
    assert rec.value("rayllm_kv_cache_usage_perc") == 0.25
    assert rec.value("rayllm_prefix_cache_queries") == 150 and rec.value("rayllm_prefix_cache_hits") == 40
    assert rec.value("rayllm_num_preemptions") == 2
    assert rec.value("rayllm_host_kv_cache_usage_perc") == 0.5 and rec.value("rayllm_prefix_cache_host_hits") == 16
    assert (rec.value("rayllm_kv_offload_blocks_out"), rec.value("rayllm_kv_offload_blocks_in")) == (3, 1)
    assert rec.value("rayllm_prompt_tokens") == 12 and rec.value("rayllm_generation_tokens") == 5
    assert rec.value("rayllm_request_success", finished_reason="stop") == 1
    assert rec.value("rayllm_request_success", finished_reason="abort") == 1
    assert rec.observed("rayllm_iteration_tokens_total") == [12, 1, 1]
    assert rec.observed("rayllm_time_to_first_token_seconds") == [0.3]
    assert rec.observed("rayllm_inter_token_latency_seconds") == [0.01, 0.02]
    assert rec.observed("rayllm_request_time_per_output_token_seconds") == [0.01]  # none for < 2 tokens
    assert rec.observed("rayllm_request_queue_time_seconds") == [0.2, 0.2]
    assert rec.observed("rayllm_request_prefill_time_seconds") == [0.1, 0.1]
    assert rec.observed("rayllm_request_decode_time_seconds") == [0.7, 0.7]
    assert rec.observed("rayllm_e2e_request_latency_seconds") == [1.0, 1.0]
    assert rec.metrics["rayllm_time_to_first_token_seconds"].boundaries[:3] == (0.001, 0.005, 0.01)
    assert rec.metrics["rayllm_request_prompt_tokens"].boundaries == build_1_2_5_buckets(2048)


def test_spec_decode_counters_are_vllms_and_exported_as_increments():
    rec = Recorder()
    m = EngineMetrics("rayllm", "tiny", max_model_len=2048, factory=rec)
    m.record({}, [])
    assert rec.value("rayllm_spec_decode_num_drafts") == 0  # exported (at 0) without speculation
    stats = {"spec_decode_num_drafts": 3, "spec_decode_num_draft_tokens": 12, "spec_decode_num_accepted_tokens": 7,
             "spec_decode_num_accepted_tokens_per_pos_0": 3, "spec_decode_num_accepted_tokens_per_pos_1": 2}
    m.record(stats, [])
    m.record({**stats, "spec_decode_num_accepted_tokens": 9, "spec_decode_num_accepted_tokens_per_pos_1": 4}, [])
    assert rec.value("rayllm_spec_decode_num_drafts") == 3 and rec.value("rayllm_spec_decode_num_draft_tokens") == 12
    assert rec.value("rayllm_spec_decode_num_accepted_tokens") == 9
    assert rec.value("rayllm_spec_decode_num_accepted_tokens_per_pos", position="0") == 3
    assert rec.value("rayllm_spec_decode_num_accepted_tokens_per_pos", position="1") == 4


def test_1_2_5_buckets():
    assert build_1_2_5_buckets(100) == (1, 2, 5, 10, 20, 50, 100)
    assert build_1_2_5_buckets(4) == (1, 2)


def test_ingress_series():
    rec = Recorder()
    m = IngressMetrics("p", "x", factory=rec)
    m.observe_batch([0.0, 0.0, 0.0])
    r = m.request(json_mode=True)
    r.chunk("engine", 4)
    r.chunk("engine", 0)
    assert rec.value("p_stream_messages", hop="engine") == 0  # per-request totals land when it ends
    r.ttft(0.05)
    r.guardrail_outcomes([("retried", "schema"), ("passed", "none")])
    r.finished(499, 1.0)
    r.finished(200, 1.0)  # recorded once
    assert rec.observed("p_ingress_batch_size") == [3] and len(rec.observed("p_ingress_batch_wait_seconds")) == 3
    assert rec.observed("p_stream_chunk_tokens", hop="engine") == [4, 0]
    # exact totals beside the histograms (Ray exports a histogram's _sum from bucket midpoints)
    assert rec.value("p_ingress_batches") == 1 and rec.value("p_ingress_batched_requests") == 3
    assert rec.value("p_stream_messages", hop="engine") == 2 and rec.value("p_stream_tokens", hop="engine") == 4
    assert rec.value("p_requests", status="499") == 1 and rec.value("p_requests", status="200") == 0
    assert rec.value("p_guardrail_outcomes", outcome="cancelled", reason="client_gone") == 1
    assert rec.value("p_guardrail_outcomes", outcome="retried", reason="schema") == 1
    assert rec.observed("p_ingress_request_latency_seconds") == []  # only successful requests
