"""Writes deploy/grafana/rayllm-dashboard.json: `python deploy/grafana/dashboard.py`.

The panels read the series Ray exports for every replica (serve_app/metrics.py, docs/metrics.md):
`ray_rayllm_*` (ours, with vLLM's names) and `ray_serve_*` (Serve's own). The same PromQL works
against a Prometheus that scrapes the Ray nodes (prometheus.yml, KubeRay's PodMonitor) or one that
scrapes the app's `GET /metrics`. tests/test_serve.py checks every series queried here exists in
a real scrape of the running app.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

P = "ray_rayllm_"
SEL = '{model_name=~"$model"}'
WINDOW = "$__rate_interval"


def q(name: str, window: bool = False) -> str:
    """A selector of one of our series, filtered by the dashboard's model variable."""
    return f"{P}{name}{SEL}" + (f"[{WINDOW}]" if window else "")


def quantiles(hist: str, by: str = "") -> list[tuple[str, str]]:
    extra = f", {by}" if by else ""
    return [(f"histogram_quantile({p}, sum by (le{extra}) (rate({q(hist + '_bucket', True)})))",
             f"p{int(p * 100)}" + (f" {{{{{by}}}}}" if by else "")) for p in (0.5, 0.9, 0.99)]


PANELS: list[tuple[str, str, list[tuple[str, str]]]] = [  # (title, unit, [(expr, legend)])
    ("Throughput: tokens/s", "short", [
        (f"sum(rate({q('generation_tokens_total', True)}))", "generated"),
        (f"sum(rate({q('prompt_tokens_total', True)}))", "prompt")]),
    ("Finished requests/s by reason", "reqps", [
        (f"sum by (finished_reason) (rate({q('request_success_total', True)}))", "{{finished_reason}}")]),
    ("HTTP requests/s by status (499: client went away)", "reqps", [
        (f"sum by (status) (rate({q('requests_total', True)}))", "{{status}}")]),
    ("Time to first token", "s", quantiles("time_to_first_token_seconds")),
    ("Inter-token latency", "s", quantiles("inter_token_latency_seconds")),
    ("Time per output token (per request)", "s", quantiles("request_time_per_output_token_seconds")),
    ("End-to-end latency (engine)", "s", quantiles("e2e_request_latency_seconds")),
    ("End-to-end latency (HTTP, Ingress)", "s", quantiles("ingress_request_latency_seconds")),
    ("Requests running / waiting (all engine replicas)", "short", [
        (f"sum({q('num_requests_running')})", "running"),
        (f"sum({q('num_requests_waiting')})", "waiting")]),
    ("Queue time / prefill time / decode time, p90", "s", [
        (f"histogram_quantile(0.9, sum by (le) (rate({q(f'request_{x}_time_seconds_bucket', True)})))", x)
        for x in ("queue", "prefill", "decode")]),
    ("KV-cache usage per engine replica (device, and the host tier: kv_offload_gb)", "percentunit", [
        (f"max by (replica) ({q('kv_cache_usage_perc')})", "{{replica}}"),
        (f"max by (replica) ({q('host_kv_cache_usage_perc')})", "{{replica}} host")]),
    ("Prefix-cache hit rate (tokens), and the share brought back from the host tier", "percentunit", [
        (f"sum(rate({q('prefix_cache_hits_total', True)})) / sum(rate({q('prefix_cache_queries_total', True)}))",
         "hit rate"),
        (f"sum(rate({q('prefix_cache_host_hits_total', True)})) / sum(rate({q('prefix_cache_queries_total', True)}))",
         "from the host tier")]),
    ("Prefix-cache hit rate per engine replica (tokens)", "percentunit", [
        (f"sum by (replica) (rate({q('prefix_cache_hits_total', True)})) / "
         f"sum by (replica) (rate({q('prefix_cache_queries_total', True)}))", "{{replica}}")]),
    ("Engine routing/s: affinity (batch, session, prefix) vs fallback, by reason", "reqps", [
        (f'sum by (decision, reason) (rate({P}router_requests_total{{model_name=~"$model",'
         f'target="EngineDeployment"}}[{WINDOW}]))', "{{decision}} {{reason}}")]),
    ("Preemptions/s", "short", [(f"sum(rate({q('num_preemptions_total', True)}))", "preemptions")]),
    ("Replicas: healthy, and the autoscaler's target", "short", [
        ('sum by (deployment) (ray_serve_deployment_replica_healthy{application=~"$app"})', "{{deployment}}"),
        ('max by (deployment) (ray_serve_autoscaling_target_replicas{application=~"$app"})', "target {{deployment}}"),
        (f"count({q('num_requests_running')})", "engine replicas reporting")]),
    ("Tokens per engine step", "short", quantiles("iteration_tokens_total")),
    ("Ingress micro-batch size (mean, p99) and wait (p99, s)", "short", [
        (f"sum(rate({q('ingress_batched_requests_total', True)})) / sum(rate({q('ingress_batches_total', True)}))",
         "mean batch size"),
        (f"histogram_quantile(0.99, sum by (le) (rate({q('ingress_batch_size_bucket', True)})))", "p99 batch size"),
        (f"histogram_quantile(0.99, sum by (le) (rate({q('ingress_batch_wait_seconds_bucket', True)})))",
         "p99 wait (s)")]),
    ("Guardrail outcomes/s", "short", [
        (f"sum by (outcome, reason) (rate({q('guardrail_outcomes_total', True)}))", "{{outcome}} {{reason}}")]),
    ("Speculative decoding: acceptance rate, tokens per verification", "short", [
        (f"sum(rate({q('spec_decode_num_accepted_tokens_total', True)})) / "
         f"sum(rate({q('spec_decode_num_draft_tokens_total', True)}))", "acceptance rate"),
        (f"1 + sum(rate({q('spec_decode_num_accepted_tokens_total', True)})) / "
         f"sum(rate({q('spec_decode_num_drafts_total', True)}))", "mean acceptance length")]),
    ("Streamed messages per token, per hop", "short", [
        (f"sum by (hop) (rate({q('stream_messages_total', True)})) / "
         f"sum by (hop) (rate({q('stream_tokens_total', True)}))", "{{hop}}")]),
]


def _panel(i: int, title: str, unit: str, targets: list[tuple[str, str]]) -> dict:
    return {
        "id": i + 1, "type": "timeseries", "title": title,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
        "targets": [{"refId": chr(ord("A") + j), "expr": expr, "legendFormat": legend}
                    for j, (expr, legend) in enumerate(targets)],
    }


def _variable(name: str, query: str) -> dict:
    return {"name": name, "type": "query", "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "query": {"query": query, "refId": name}, "refresh": 2, "includeAll": True, "multi": True,
            "allValue": ".*", "current": {"text": "All", "value": "$__all"}}


def dashboard() -> dict:
    return {
        "uid": "rayllm-serving", "title": "rayllm: LLM serving on Ray Serve", "schemaVersion": 39,
        "tags": ["rayllm", "llm", "ray-serve"], "timezone": "browser", "refresh": "10s",
        "time": {"from": "now-30m", "to": "now"},
        "templating": {"list": [
            {"name": "datasource", "type": "datasource", "query": "prometheus", "current": {}},
            _variable("model", f"label_values({P}num_requests_running, model_name)"),
            _variable("app", "label_values(ray_serve_deployment_replica_healthy, application)"),
        ]},
        "panels": [_panel(i, *p) for i, p in enumerate(PANELS)],
    }


def queried_series(board: dict) -> set[str]:
    """The metric names a dashboard's queries read (histograms as their _bucket/_sum/_count series)."""
    exprs = [t["expr"] for p in board["panels"] for t in p["targets"]]
    exprs += [v["query"]["query"] for v in board["templating"]["list"] if isinstance(v.get("query"), dict)]
    return {name for e in exprs for name in re.findall(r"\b(ray_[a-z0-9_]+)", e)}


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


if __name__ == "__main__":
    out = Path(__file__).with_name("rayllm-dashboard.json")
    out.write_text(render())
    print(f"wrote {out}")
