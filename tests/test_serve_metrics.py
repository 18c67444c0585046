"""Prometheus text of an Ingress replica (no Ray): names, engine gauges summed over fresh replicas."""
from serve_app.metrics import ServeMetrics


def test_names_and_engine_gauges():
    m = ServeMetrics("rayllm", "tiny")
    m.engine_stats({"replica": "a", "num_requests_running": 2, "num_requests_waiting": 1, "kv_cache_usage": 0.5})
    m.engine_stats({"replica": "b", "num_requests_running": 3, "num_requests_waiting": 0, "kv_cache_usage": 0.1})
    r = m.request()
    r.ttft(0.05)
    r.finished(200, 1.2, 7)
    r.finished(200, 1.2, 7)  # recorded once
    text = m.render().decode()
    assert 'rayllm_num_requests_running{model_name="tiny"} 5.0' in text
    assert 'rayllm_num_requests_waiting{model_name="tiny"} 1.0' in text
    assert 'rayllm_kv_cache_usage_perc{model_name="tiny"} 0.3' in text
    assert 'rayllm_time_to_first_token_seconds_count{model_name="tiny"} 1.0' in text
    assert 'rayllm_requests_total{model_name="tiny",status="200"} 1.0' in text
    assert 'rayllm_generation_tokens_total{model_name="tiny"} 7.0' in text


def test_stale_replicas_drop_out():
    m = ServeMetrics("p", "x", stats_ttl_s=0.0)
    m.engine_stats({"replica": "a", "num_requests_running": 4})
    import time
    time.sleep(0.01)
    assert 'p_num_requests_running{model_name="x"} 0.0' in m.render().decode()
