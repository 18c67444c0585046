"""deploy/grafana: the dashboard is what its generator writes, its queries are well formed, the scrape
configs parse. (That every series it queries exists in a real scrape: tests/test_serve.py.)"""
import importlib.util
import json
from pathlib import Path

import yaml

GRAFANA = Path(__file__).resolve().parents[1] / "deploy" / "grafana"


def load_dashboard_module():
    spec = importlib.util.spec_from_file_location("rayllm_dashboard", GRAFANA / "dashboard.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_dashboard_is_the_generated_one():
    assert (GRAFANA / "rayllm-dashboard.json").read_text() == load_dashboard_module().render(), \
        "run: python deploy/grafana/dashboard.py"


def test_every_panel_queries_our_series_with_balanced_expressions():
    board = json.loads((GRAFANA / "rayllm-dashboard.json").read_text())
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids)) >= 15
    for panel in board["panels"]:
        assert panel["targets"], panel["title"]
        for t in panel["targets"]:
            assert t["expr"].count("(") == t["expr"].count(")") and t["expr"].count("{") == t["expr"].count("}")
    series = load_dashboard_module().queried_series(board)
    for name in ("ray_rayllm_time_to_first_token_seconds_bucket", "ray_rayllm_kv_cache_usage_perc",
                 "ray_rayllm_prefix_cache_hits_total", "ray_rayllm_num_preemptions_total",
                 "ray_serve_deployment_replica_healthy", "ray_rayllm_ingress_batches_total",
                 "ray_rayllm_guardrail_outcomes_total"):
        assert name in series


def test_scrape_configs_parse():
    prom = yaml.safe_load((GRAFANA / "prometheus.yml").read_text())
    (job,) = prom["scrape_configs"]
    assert job["file_sd_configs"][0]["files"] == ["/tmp/ray/prom_metrics_service_discovery.json"]
    monitors = list(yaml.safe_load_all((GRAFANA / "kuberay-podmonitor.yaml").read_text()))
    assert {m["spec"]["selector"]["matchLabels"]["ray.io/node-type"] for m in monitors} == {"head", "worker"}
    assert all(m["kind"] == "PodMonitor" and m["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
               for m in monitors)
