"""Prometheus metrics of an Ingress replica, named as vLLM's under our prefix (`rayllm_*` for `vllm:*`).

Each Ingress replica owns its registry; `GET /metrics` returns that replica's view:

- request-side series (TTFT, e2e latency, request counts, tokens, micro-batch sizes) count
  the requests *this Ingress replica* served;
- engine gauges (running / waiting requests, KV usage) are the sum over the engine
  replicas this Ingress heard from in the last `stats_ttl_s`: each finished request
  carries its engine replica's stats, and each scrape asks one engine replica afresh.

With one Ingress replica (the default) a scrape is the whole picture. With several,
one scrape (routed by the Serve proxy to one of them) is partial: scrape the replicas
one by one, or use Ray's own metrics export, which labels by replica.
"""
from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# vLLM's buckets for TTFT and e2e latency, in seconds.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0, 1920.0, 7680.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_CHUNK_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)

_ENGINE_GAUGES = {  # engine stats key -> (metric suffix, help)
    "num_requests_running": ("num_requests_running", "Requests running in the engines (scheduled this step)."),
    "num_requests_waiting": ("num_requests_waiting", "Requests waiting in the engines' queues."),
    "kv_cache_usage": ("kv_cache_usage_perc", "KV-cache usage, 0..1 (mean over engine replicas)."),
    "prefix_cache_hit_rate": ("prefix_cache_hit_rate", "Prefix-cache hit rate, 0..1 (mean over engine replicas)."),
}
_MEANS = {"kv_cache_usage", "prefix_cache_hit_rate"}


class ServeMetrics:
    def __init__(self, prefix: str, model_name: str, stats_ttl_s: float = 15.0):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.stats_ttl_s = stats_ttl_s
        self._engine_stats: dict[str, tuple[float, dict[str, Any]]] = {}  # replica -> (monotonic time, stats)
        r, labels = self.registry, ["model_name"]
        self.gauges = {key: Gauge(f"{prefix}_{suffix}", doc, labels, registry=r)
                       for key, (suffix, doc) in _ENGINE_GAUGES.items()}
        self.engine_replicas = Gauge(f"{prefix}_engine_replicas_reporting",
                                     "Engine replicas whose stats are in the gauges.", labels, registry=r)
        self.ttft = Histogram(f"{prefix}_time_to_first_token_seconds", "Time to first token, as the Ingress sees it.",
                              labels, buckets=_TTFT_BUCKETS, registry=r)
        self.e2e = Histogram(f"{prefix}_e2e_request_latency_seconds", "Request latency, arrival to last token.",
                             labels, buckets=_E2E_BUCKETS, registry=r)
        self.requests = Counter(f"{prefix}_requests", "Finished requests by HTTP status (499: client went away).",
                                labels + ["status"], registry=r)
        self.generation_tokens = Counter(f"{prefix}_generation_tokens", "Generated tokens.", labels, registry=r)
        self.batch_size = Histogram(f"{prefix}_ingress_batch_size", "Requests per Ingress micro-batch.",
                                    labels, buckets=_BATCH_BUCKETS, registry=r)
        # Tokens per streamed message, per hop: `_count` over `_sum` is messages per token, the
        # figure that says whether a hop pays per token or per chunk (loadtest.overhead reads it).
        self.chunk_tokens = Histogram(f"{prefix}_stream_chunk_tokens",
                                      "Tokens per streamed message: hop engine (engine replica -> Ingress) "
                                      "or client (Ingress -> HTTP client).",
                                      labels + ["hop"], buckets=_CHUNK_BUCKETS, registry=r)
        self.guardrail = Counter(f"{prefix}_guardrail_outcomes",
                                 "JSON guardrail validations of a completion: outcome passed|retried|rejected, "
                                 "reason none|redacted or the violation (docs/guardrails.md).",
                                 labels + ["outcome", "reason"], registry=r)

    def request(self) -> "RequestMetrics":
        return RequestMetrics(self)

    def engine_stats(self, stats: dict[str, Any]) -> None:
        self._engine_stats[str(stats.get("replica", "?"))] = (time.monotonic(), stats)

    def count_status(self, status: int) -> None:
        self.requests.labels(self.model_name, str(status)).inc()

    def count_guardrail(self, outcome: str, reason: str) -> None:
        self.guardrail.labels(self.model_name, outcome, reason).inc()

    def observe_batch(self, size: int) -> None:
        self.batch_size.labels(self.model_name).observe(size)

    def render(self) -> bytes:
        self._refresh_engine_gauges()
        return generate_latest(self.registry)

    def _refresh_engine_gauges(self) -> None:
        now = time.monotonic()
        fresh = {k: s for k, (t, s) in self._engine_stats.items() if now - t <= self.stats_ttl_s}
        self._engine_stats = {k: v for k, v in self._engine_stats.items() if k in fresh}
        for key, gauge in self.gauges.items():
            values = [float(s.get(key, 0.0)) for s in fresh.values()]
            total = sum(values)
            if key in _MEANS and values:
                total /= len(values)
            gauge.labels(self.model_name).set(total)
        self.engine_replicas.labels(self.model_name).set(len(fresh))


class RequestMetrics:
    """One request's observations, recorded once each."""

    def __init__(self, metrics: ServeMetrics):
        self._m = metrics
        self._done = False

    def engine_stats(self, stats: dict[str, Any]) -> None:
        self._m.engine_stats(stats)

    def guardrail_outcomes(self, outcomes: list[tuple[str, str]]) -> None:
        for outcome, reason in outcomes:
            self._m.count_guardrail(outcome, reason)

    def chunk(self, hop: str, num_tokens: int) -> None:
        self._m.chunk_tokens.labels(self._m.model_name, hop).observe(num_tokens)

    def ttft(self, seconds: float) -> None:
        self._m.ttft.labels(self._m.model_name).observe(seconds)

    def finished(self, status: int, seconds: float, generated_tokens: int) -> None:
        if self._done:
            return
        self._done = True
        m = self._m
        m.count_status(status)
        if status == 200:
            m.e2e.labels(m.model_name).observe(seconds)
        if generated_tokens:
            m.generation_tokens.labels(m.model_name).inc(generated_tokens)
