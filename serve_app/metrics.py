"""The application's metrics: vLLM's series under our prefix, plus the serving tier's own, all through Ray's.

Every series is a `ray.serve.metrics` object (`ray.util.metrics` plus the `deployment`,
`replica` and `application` labels of the replica that records it), so Ray's per-node
metrics export carries every replica of every deployment: the Prometheus that scrapes a Ray
cluster (KubeRay's PodMonitor, or `deploy/grafana/prometheus.yml`) sees the whole app, and
`GET /metrics` on the HTTP port serves the same text (serve_app/http/cluster_metrics.py).
Ray exports a series named `rayllm_x` as `ray_rayllm_x` (a counter as `ray_rayllm_x_total`).
What each series means, and which alerts to set: docs/metrics.md.

    EngineDeployment replica: EngineMetrics  <- AsyncLLM.get_stats() + pop_iteration_stats(), every 0.5 s
    Ingress replica:          IngressMetrics <- each HTTP request, each micro-batch
"""
from __future__ import annotations

import time
from typing import Any, Callable, Iterable

from engine.core.stats import SPEC_DECODE_PER_POS_KEY, IterationStats
from serve_app.http.access_log import RequestInfo, log_access

# vLLM's bucket layouts (vllm/v1/metrics/loggers.py), in seconds or tokens.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# Ours: requests per Ingress micro-batch, the wait in its queue, tokens per streamed message.
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
BATCH_WAIT_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
CHUNK_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)

Factory = Callable[..., Any]  # (kind, name, description, tag_keys, boundaries) -> a metric


def ray_metric(kind: str, name: str, description: str, tag_keys: tuple[str, ...],
               boundaries: Iterable[float] | None = None):
    """A Ray metric; inside a Serve replica it also carries the replica's deployment/replica/application."""
    from ray.serve import metrics  # here: importing Ray is not needed to read this module's tables

    cls = {"counter": metrics.Counter, "gauge": metrics.Gauge, "histogram": metrics.Histogram}[kind]
    kwargs = {"boundaries": list(boundaries)} if kind == "histogram" else {}
    return cls(name, description=description, tag_keys=tag_keys, **kwargs)


def build_1_2_5_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's layout for prompt and generation lengths)."""
    out, exponent = [], 0
    while True:
        for m in (1, 2, 5):
            value = m * 10 ** exponent
            if value > max_value:
                return tuple(out)
            out.append(value)
        exponent += 1


class _Series:
    """Makes the metrics of one replica, each with the model_name label set."""

    def __init__(self, prefix: str, model_name: str, factory: Factory):
        self.prefix, self.model_name, self.factory = prefix, model_name, factory
        self.tags = {"model_name": model_name}

    def make(self, kind: str, suffix: str, doc: str, extra_tags: tuple[str, ...] = (), buckets=None):
        metric = self.factory(kind, f"{self.prefix}_{suffix}", doc, ("model_name", *extra_tags), buckets)
        metric.set_default_tags(dict(self.tags))  # a copy: Serve adds its replica tags to the dict
        return metric


def _start_at_zero(counter, tags: dict[str, str] | None = None) -> None:
    """Export a counter at 0 before its first event (Prometheus' advice: `increase()` then sees the
    first one, and a dashboard's rare series, preemptions, exist at all). Ray's inc() refuses 0."""
    record = getattr(counter, "_record", None)
    if record is not None:
        record(0.0, tags=tags)


class EngineMetrics:
    """One engine replica's series, with vLLM's names and meanings."""

    _GAUGES = {  # AsyncLLM.get_stats() key -> (suffix, help)
        "num_requests_running": ("num_requests_running", "Requests in the engine's running batch."),
        "num_requests_waiting": ("num_requests_waiting", "Requests waiting in the engine's queue."),
        "kv_cache_usage": ("kv_cache_usage_perc", "KV-cache usage, 0..1 (1: every block in use)."),
        "host_kv_cache_usage": ("host_kv_cache_usage_perc", "Host KV tier usage, 0..1 (kv_offload_gb; 0 without it)."),
    }
    _COUNTERS = {  # lifetime key of get_stats() -> (suffix, help); exported as increments
        "prefix_cache_queries": ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
        "prefix_cache_hits": ("prefix_cache_hits", "Prompt tokens found in the prefix cache."),
        "num_preemptions": ("num_preemptions", "Requests preempted (KV blocks taken back, recomputed later)."),
        # The host KV tier (kv_offload_gb, docs/fleet.md; 0 without it).
        "prefix_cache_host_hits": ("prefix_cache_host_hits", "Prompt tokens of prefix-cache hits copied back "
                                   "from the host KV tier (also counted in prefix_cache_hits)."),
        "kv_offload_blocks_out": ("kv_offload_blocks_out", "KV blocks copied from the device pool to the host tier."),
        "kv_offload_blocks_in": ("kv_offload_blocks_in", "KV blocks copied back from the host tier on a hit."),
        # Speculative decoding (engine/spec_decode; 0 without speculative_config), vLLM's series.
        "spec_decode_num_drafts": ("spec_decode_num_drafts", "Draft verifications (a sequence's drafts in one step)."),
        "spec_decode_num_draft_tokens": ("spec_decode_num_draft_tokens", "Draft tokens verified."),
        "spec_decode_num_accepted_tokens": ("spec_decode_num_accepted_tokens", "Draft tokens accepted."),
    }

    def __init__(self, prefix: str, model_name: str, max_model_len: int, factory: Factory = ray_metric):
        s = _Series(prefix, model_name, factory)
        self.gauges = {k: s.make("gauge", suffix, doc) for k, (suffix, doc) in self._GAUGES.items()}
        self.counters = {k: s.make("counter", suffix, doc) for k, (suffix, doc) in self._COUNTERS.items()}
        self._last = dict.fromkeys(self._COUNTERS, 0.0)
        self.prompt_tokens = s.make("counter", "prompt_tokens", "Prefill tokens (cached ones included).")
        self.generation_tokens = s.make("counter", "generation_tokens", "Generated tokens.")
        self.request_success = s.make("counter", "request_success", "Finished requests by finished_reason "
                                      "(stop|length|abort).", ("finished_reason",))
        h = lambda suffix, doc, buckets: s.make("histogram", suffix, doc, buckets=buckets)  # noqa: E731
        self.ttft = h("time_to_first_token_seconds", "Arrival in the engine to first token.", TTFT_BUCKETS)
        self.itl = h("inter_token_latency_seconds", "Between two steps that gave a request tokens.", ITL_BUCKETS)
        self.tpot = h("request_time_per_output_token_seconds", "A finished request's decode time per token "
                      "after the first.", ITL_BUCKETS)
        self.latency = {name: h(f"{name}_seconds" if name.startswith("e2e") else f"request_{name}_time_seconds",
                                doc, REQUEST_LATENCY_BUCKETS) for name, doc in (
            ("e2e_request_latency", "Arrival in the engine to finished."),
            ("queue", "Arrival to first scheduled."),
            ("prefill", "First scheduled to first token."),
            ("decode", "First token to last token."),
            ("inference", "First scheduled to last token."))}
        self.iteration_tokens = h("iteration_tokens_total", "Tokens computed per engine step.",
                                  ITERATION_TOKEN_BUCKETS)
        self.accepted_per_pos = s.make("counter", "spec_decode_num_accepted_tokens_per_pos",
                                       "Draft tokens accepted, by position in the draft (0: the first).",
                                       ("position",))
        self._last_per_pos: dict[str, float] = {}  # get_stats() key -> its lifetime value last exported
        for counter in (*self.counters.values(), self.prompt_tokens, self.generation_tokens):
            _start_at_zero(counter)
        for reason in ("stop", "length", "abort"):
            _start_at_zero(self.request_success, {"finished_reason": reason})
        self.lora_loads = s.make("counter", "lora_adapter_loads", "LoRA adapters loaded into this replica, by "
                                 "lora_name: once while it stays among the replica's max_cpu_loras.", ("lora_name",))
        lengths = build_1_2_5_buckets(max_model_len)
        self.request_prompt_tokens = h("request_prompt_tokens", "Prompt length of finished requests.", lengths)
        self.request_generation_tokens = h("request_generation_tokens", "Generated tokens of finished requests.",
                                           lengths)

    def count_lora_load(self, lora_name: str) -> None:
        self.lora_loads.inc(1, tags={"lora_name": lora_name})

    def record(self, stats: dict[str, Any], iterations: list[IterationStats]) -> None:
        for key, gauge in self.gauges.items():
            gauge.set(float(stats.get(key, 0.0)))
        for key, counter in self.counters.items():
            value = float(stats.get(key, 0.0))
            if value > self._last[key]:
                counter.inc(value - self._last[key])
                self._last[key] = value
        self._record_accepted_per_pos(stats)
        for it in iterations:
            self._record_iteration(it)

    def _record_accepted_per_pos(self, stats: dict[str, Any]) -> None:
        """The per-position lifetime counters (`spec_decode_num_accepted_tokens_per_pos_<i>`), as increments."""
        for key, value in stats.items():
            if key.startswith(SPEC_DECODE_PER_POS_KEY) and value > self._last_per_pos.get(key, 0.0):
                position = key[len(SPEC_DECODE_PER_POS_KEY):]
                self.accepted_per_pos.inc(value - self._last_per_pos.get(key, 0.0), tags={"position": position})
                self._last_per_pos[key] = float(value)

    def _record_iteration(self, it: IterationStats) -> None:
        if it.num_prompt_tokens:
            self.prompt_tokens.inc(it.num_prompt_tokens)
        if it.num_generation_tokens:
            self.generation_tokens.inc(it.num_generation_tokens)
        for n in it.iteration_tokens:
            self.iteration_tokens.observe(n)
        for t in it.time_to_first_tokens:
            self.ttft.observe(t)
        for t in it.inter_token_latencies:
            self.itl.observe(t)
        for r in it.finished_requests:
            self.request_success.inc(1, tags={"finished_reason": r.finish_reason})
            for name, value in (("e2e_request_latency", r.e2e_latency), ("queue", r.queued_time),
                                ("prefill", r.prefill_time), ("decode", r.decode_time),
                                ("inference", r.inference_time)):
                self.latency[name].observe(value)
            if r.time_per_output_token is not None:
                self.tpot.observe(r.time_per_output_token)
            self.request_prompt_tokens.observe(r.num_prompt_tokens)
            self.request_generation_tokens.observe(r.num_generation_tokens)


class IngressMetrics:
    """One Ingress replica's series: HTTP outcomes as the client sees them, micro-batching, hops, guardrail."""

    def __init__(self, prefix: str, model_name: str, factory: Factory = ray_metric):
        s = _Series(prefix, model_name, factory)
        self.requests = s.make("counter", "requests", "HTTP requests by status (499: the client went away).",
                               ("status",))
        self.ttft = s.make("histogram", "ingress_time_to_first_token_seconds", "HTTP request to its first token "
                           "(tokenization, batching and hops included).", buckets=TTFT_BUCKETS)
        self.e2e = s.make("histogram", "ingress_request_latency_seconds", "HTTP request to its last token, "
                          "successful requests.", buckets=REQUEST_LATENCY_BUCKETS)
        self.batch_size = s.make("histogram", "ingress_batch_size", "Requests per Ingress micro-batch.",
                                 buckets=BATCH_BUCKETS)
        self.batch_wait = s.make("histogram", "ingress_batch_wait_seconds", "Time a request waited in the "
                                 "Ingress micro-batch queue.", buckets=BATCH_WAIT_BUCKETS)
        # Exact totals beside the histograms: Ray exports a histogram's `_sum` rebuilt from bucket
        # midpoints (approximate), so means are taken from these counters instead.
        self.batches = s.make("counter", "ingress_batches", "Ingress micro-batches.")
        self.batched_requests = s.make("counter", "ingress_batched_requests", "Requests in Ingress micro-batches.")
        self.stream_messages = s.make("counter", "stream_messages", "Streamed messages, per hop.", ("hop",))
        self.stream_tokens = s.make("counter", "stream_tokens", "Tokens in streamed messages, per hop: "
                                    "messages / tokens says whether a hop pays per token or per chunk.", ("hop",))
        # Tokens per streamed message, per hop (loadtest.overhead reads the counters above).
        self.chunk_tokens = s.make("histogram", "stream_chunk_tokens", "Tokens per streamed message: hop engine "
                                   "(engine replica -> Ingress) or client (Ingress -> HTTP client).", ("hop",),
                                   buckets=CHUNK_BUCKETS)
        self.guardrail = s.make("counter", "guardrail_outcomes", "JSON guardrail validations: outcome passed|"
                                "retried|rejected (reason: none|redacted or the violation), or cancelled "
                                "(reason client_gone).", ("outcome", "reason"))

    def request(self, json_mode: bool = False, info: RequestInfo | None = None) -> "RequestRecorder":
        """A recorder for one HTTP request; with `info`, its end is also a line of the access log."""
        return RequestRecorder(self, json_mode, info)

    def count_status(self, status: int) -> None:
        self.requests.inc(1, tags={"status": str(status)})

    def count_guardrail(self, outcome: str, reason: str) -> None:
        self.guardrail.inc(1, tags={"outcome": outcome, "reason": reason})

    def observe_batch(self, submit_times: list[float]) -> None:
        """A micro-batch starts: its size, and how long each of its requests waited for it."""
        now = time.monotonic()
        self.batch_size.observe(len(submit_times))
        self.batches.inc(1)
        self.batched_requests.inc(len(submit_times))
        for t in submit_times:
            self.batch_wait.observe(max(now - t, 0.0))


class RequestRecorder:
    """Records one HTTP request into IngressMetrics, the final status once (not engine/outputs.py's
    RequestMetrics, which holds one engine request's timestamps), and its access-log line."""

    def __init__(self, metrics: IngressMetrics, json_mode: bool, info: RequestInfo | None = None):
        self._m = metrics
        self._json_mode = json_mode
        self._info = info
        self._done = False
        # hop -> [messages, tokens], added to the counters once, when the request ends: a Ray
        # metric call per streamed message raised the Ingress's CPU per token (docs/benchmarks.md,
        # "Serving overhead re-measured after issues 9/11/12/13 landed").
        self._streamed: dict[str, list[int]] = {}

    def guardrail_outcomes(self, outcomes: list[tuple[str, str]]) -> None:
        for outcome, reason in outcomes:
            self._m.count_guardrail(outcome, reason)

    def chunk(self, hop: str, num_tokens: int) -> None:
        self._m.chunk_tokens.observe(num_tokens, tags={"hop": hop})
        totals = self._streamed.setdefault(hop, [0, 0])
        totals[0] += 1
        totals[1] += num_tokens

    def _flush_streamed(self) -> None:
        for hop, (messages, tokens) in self._streamed.items():
            tags = {"hop": hop}
            self._m.stream_messages.inc(messages, tags=tags)
            if tokens:
                self._m.stream_tokens.inc(tokens, tags=tags)
        self._streamed.clear()

    def ttft(self, seconds: float) -> None:
        self._m.ttft.observe(seconds)

    def finished(self, status: int, seconds: float) -> None:
        if self._done:
            return
        self._done = True
        if self._info is not None:
            info = self._info
            log_access(info.method, info.route, status, time.monotonic() - info.arrival, info.num_prompt_tokens,
                       self._streamed.get("engine", (0, 0))[1], info.request_id)
        self._flush_streamed()
        self._m.count_status(status)
        if status == 200:
            self._m.e2e.observe(seconds)
        elif status == 499 and self._json_mode:  # the guardrail's work ended by the client leaving
            self._m.count_guardrail("cancelled", "client_gone")


async def record_engine_metrics(metrics: EngineMetrics, llm, interval_s: float = 0.5) -> None:
    """An engine replica's recorder task: the AsyncLLM's gauges and observations, every interval_s, forever."""
    import asyncio
    import logging

    while True:
        try:
            metrics.record(llm.get_stats(), llm.pop_iteration_stats())
        except Exception:  # noqa: BLE001 - metrics must never take the replica down; say so and go on
            logging.getLogger(f"ray.serve.{__name__}").exception("recording engine metrics failed")
        await asyncio.sleep(interval_s)
