"""serve_app/http/cluster_metrics.py: merging the metrics exports of several Ray nodes into one scrape."""
from prometheus_client.parser import text_string_to_metric_families

from serve_app.http.cluster_metrics import merge_exports

NODE_A = """# HELP ray_rayllm_prompt_tokens_total Prefill tokens.
# TYPE ray_rayllm_prompt_tokens_total counter
ray_rayllm_prompt_tokens_total{WorkerId="a",replica="r1",otel_scope_name="x"} 12.0
# HELP ray_rayllm_time_to_first_token_seconds Arrival to first token.
# TYPE ray_rayllm_time_to_first_token_seconds histogram
ray_rayllm_time_to_first_token_seconds_bucket{le="0.1",replica="r1"} 1.0
ray_rayllm_time_to_first_token_seconds_bucket{le="+Inf",replica="r1"} 2.0
ray_rayllm_time_to_first_token_seconds_count{replica="r1"} 2.0
ray_rayllm_time_to_first_token_seconds_sum{replica="r1"} 0.5
# HELP ray_node_cpu_count Not ours.
# TYPE ray_node_cpu_count gauge
ray_node_cpu_count 2.0
"""
NODE_B = """# HELP ray_rayllm_prompt_tokens_total Prefill tokens.
# TYPE ray_rayllm_prompt_tokens_total counter
ray_rayllm_prompt_tokens_total{WorkerId="b",replica="r2"} 30.0
# HELP ray_serve_deployment_replica_healthy Healthy.
# TYPE ray_serve_deployment_replica_healthy gauge
ray_serve_deployment_replica_healthy{deployment="EngineDeployment",replica="r2"} 1.0
"""


def test_union_of_nodes_one_family_each_ours_only():
    text = merge_exports([NODE_A, NODE_B], ("ray_rayllm_", "ray_serve_"))
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    assert set(fams) == {"ray_rayllm_prompt_tokens", "ray_rayllm_time_to_first_token_seconds",
                         "ray_serve_deployment_replica_healthy"}
    tokens = {s.labels["replica"]: s.value for s in fams["ray_rayllm_prompt_tokens"].samples}
    assert tokens == {"r1": 12.0, "r2": 30.0}  # both replicas, summable in PromQL
    assert text.count("# TYPE ray_rayllm_prompt_tokens_total counter") == 1
    assert "otel_scope_name" not in text
    assert len(fams["ray_rayllm_time_to_first_token_seconds"].samples) == 4


def test_nothing_to_merge_is_empty():
    assert merge_exports([], ("ray_rayllm_",)) == ""
