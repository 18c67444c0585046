"""The application's arguments: validated once, at `build_app`, with errors that name the bad arg.

They come from `deploy/config.yaml` (`applications[].args`) or from the command line
(`serve run serve_app.app:build_app model=... max_batch_size=8`), where every value
arrives as a string: pydantic's lax mode turns "8" into 8 and "true" into True.
"""
from __future__ import annotations

import os
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from engine.config import EngineConfig
from serve_app.guardrail_policy import GuardrailPolicy

STREAM_INTERVAL_MS = 20.0
_METRIC_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")


class BatchingConfig(BaseModel):
    """What `user_config` may change on a running Ingress (`reconfigure()`), without a restart."""

    model_config = ConfigDict(extra="forbid")

    max_batch_size: int = Field(8, ge=1, description="1 turns micro-batching off (a direct path, no queue)")
    # 0: no waiting; a batch is whatever queued up while the previous one was being prepared
    # (no added latency when idle, batches under load). Measured: docs/benchmarks.md.
    batch_wait_timeout_s: float = Field(0.0, ge=0.0, le=10.0)
    # Admission control: requests in flight in one Ingress replica beyond which it answers
    # 503 + Retry-After instead of queueing. None: never shed.
    max_pending_requests: int | None = Field(None, ge=0)


class StreamingConfig(BaseModel):
    """What `user_config` may change on a running EngineDeployment (`reconfigure()`)."""

    model_config = ConfigDict(extra="forbid")

    # Between two streamed items of one request, wait up to this long so that each carries
    # several steps' tokens: every item costs a Ray message and per-item work in the
    # Ingress and the proxy. The first token and the end are never held back.
    # 0: an item per engine step (per token when the replica keeps up). Measured: docs/benchmarks.md.
    stream_interval_ms: float = Field(STREAM_INTERVAL_MS, ge=0.0, le=1000.0)


class AppArgs(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    # -- the model and the engine (one AsyncLLM per EngineDeployment replica) --
    model: str = Field(min_length=1)
    served_model_name: str | None = None  # None: the model path's last component
    tokenizer: str | None = None
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    tensor_parallel_size: int = Field(1, ge=1)
    max_num_seqs: int = Field(256, ge=1)
    max_num_batched_tokens: int | None = Field(None, ge=1)
    max_model_len: int | None = Field(None, ge=1)
    block_size: int = Field(16, ge=8)
    num_kv_blocks: int | None = Field(None, ge=1)
    gpu_memory_utilization: float = Field(0.9, gt=0.0, le=1.0)
    cpu_kv_cache_gb: float = Field(4.0, gt=0.0)
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    attention_backend: Literal["auto", "triton", "torch"] = "auto"
    seed: int = 0
    async_scheduling: bool | None = None  # None: on for CUDA with tensor_parallel_size 1
    # Check at build_app that the checkpoint exists and is supported. Turn off where the node
    # that builds the app (the head) cannot see the checkpoint that the engine nodes load.
    check_model_at_build: bool = True

    # -- micro-batching in the Ingress (initial values; user_config can change them live) --
    max_batch_size: int = Field(8, ge=1)
    batch_wait_timeout_s: float = Field(0.0, ge=0.0, le=10.0)

    # -- chunked streaming out of the engine replica (user_config can change it live) --
    stream_interval_ms: float = Field(STREAM_INTERVAL_MS, ge=0.0, le=1000.0)

    # -- replicas, autoscaling and load shedding --
    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(1, ge=1)
    initial_replicas: int | None = Field(None, ge=0)
    # Serve adds engine replicas when the mean ongoing requests per replica (running in the
    # engine's batch + queued in it) exceed this. None: max_num_seqs, a full batch: below it a
    # replica takes more load into the same steps; above it requests queue and TTFT grows.
    target_ongoing_requests: float | None = Field(None, gt=0.0)
    # Serve's autoscaler timing (None: Serve's defaults: 30 s up, 600 s down, 10 s / 30 s windows).
    upscale_delay_s: float | None = Field(None, ge=0.0)
    downscale_delay_s: float | None = Field(None, ge=0.0)
    look_back_period_s: float | None = Field(None, gt=0.0)
    metrics_interval_s: float | None = Field(None, gt=0.0)
    ingress_replicas: int = Field(1, ge=1)
    ingress_max_ongoing_requests: int = Field(1024, ge=1)
    engine_max_ongoing_requests: int | None = Field(None, ge=1)  # None: 2 * max_num_seqs
    max_queued_requests: int = Field(-1, ge=-1)  # per caller of the engine; -1: unbounded
    max_pending_requests: int | None = Field(None, ge=0)
    retry_after_s: int = Field(1, ge=0)
    engine_num_cpus: float = Field(1.0, ge=0.0)
    # torch threads of a CPU engine replica (split over its TP ranks). Ray sets OMP_NUM_THREADS
    # to the actor's num_cpus (1), which made the served engine single-threaded: 0.46 of the
    # engine's offline speed (docs/benchmarks.md). None: every core the replica may run on.
    engine_cpu_threads: int | None = Field(None, ge=1)
    # "batch_affinity": one engine replica per Ingress micro-batch (serve_app.routing);
    # "power_of_two": Serve's default, a choice per request.
    request_router: Literal["batch_affinity", "power_of_two"] = "batch_affinity"

    # -- replica lifecycle --
    health_check_period_s: float = Field(10.0, gt=0.0)
    health_check_timeout_s: float = Field(30.0, gt=0.0)
    graceful_shutdown_timeout_s: float = Field(20.0, ge=0.0)

    # -- the Guardrails deployment (JSON requests): its policy (serve_app.guardrail_policy) --
    guardrails: dict[str, Any] = Field(default_factory=dict)

    # -- the HTTP surface --
    api_key: str | None = None
    max_request_body_bytes: int = Field(2 * 1024 * 1024, ge=1024)
    metrics_prefix: str = "rayllm"

    @model_validator(mode="after")
    def _check_relations(self) -> "AppArgs":
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas={self.min_replicas} must be <= max_replicas={self.max_replicas}")
        if self.initial_replicas is not None and not self.min_replicas <= self.initial_replicas <= self.max_replicas:
            raise ValueError(f"initial_replicas={self.initial_replicas} must lie in "
                             f"[min_replicas={self.min_replicas}, max_replicas={self.max_replicas}]")
        if not _METRIC_NAME.match(self.metrics_prefix):
            raise ValueError(f"metrics_prefix={self.metrics_prefix!r} is not a valid Prometheus name prefix")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty (leave it unset to serve without a key)")
        try:
            GuardrailPolicy.from_args(self.guardrails)  # a bad regex or limit fails here, at start
        except ValueError as e:
            raise ValueError(f"guardrails: {e}") from None
        return self

    # -- derived values ------------------------------------------------------------
    @property
    def model_name(self) -> str:
        return self.served_model_name or os.path.basename(os.path.normpath(self.model)) or self.model

    def engine_config(self, device: str) -> EngineConfig:
        """The EngineConfig for one replica (plain values; touches no disk)."""
        return EngineConfig(
            model=self.model, tokenizer=self.tokenizer, dtype=self.dtype, device=device,
            tensor_parallel_size=self.tensor_parallel_size, max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens, max_model_len=self.max_model_len,
            block_size=self.block_size, num_kv_blocks=self.num_kv_blocks,
            gpu_memory_utilization=self.gpu_memory_utilization, cpu_kv_cache_gb=self.cpu_kv_cache_gb,
            enable_prefix_caching=self.enable_prefix_caching, enforce_eager=self.enforce_eager,
            attention_backend=self.attention_backend, seed=self.seed, async_scheduling=self.async_scheduling)

    def autoscaling_config(self) -> dict[str, Any]:
        """The engine deployment's Serve autoscaling_config."""
        config: dict[str, Any] = {"min_replicas": self.min_replicas, "max_replicas": self.max_replicas,
                                  "target_ongoing_requests": self.target_ongoing_requests or float(self.max_num_seqs)}
        for name in ("initial_replicas", "upscale_delay_s", "downscale_delay_s", "look_back_period_s",
                     "metrics_interval_s"):
            if getattr(self, name) is not None:
                config[name] = getattr(self, name)
        return config

    def streaming(self) -> StreamingConfig:
        return StreamingConfig(stream_interval_ms=self.stream_interval_ms)

    def batching(self) -> BatchingConfig:
        return BatchingConfig(max_batch_size=self.max_batch_size, batch_wait_timeout_s=self.batch_wait_timeout_s,
                              max_pending_requests=self.max_pending_requests)


def parse_app_args(args: dict[str, Any] | None) -> AppArgs:
    """Validate `args`; a bad one fails here, at start, with a message naming it."""
    try:
        parsed = AppArgs.model_validate(dict(args or {}))
        parsed.engine_config("cpu")  # the engine's own checks (block_size multiple of 8, ...)
    except ValidationError as e:
        raise ValueError("invalid application args: " + describe_validation_error(e)) from None
    except ValueError as e:
        raise ValueError(f"invalid application args: {e}") from None
    return parsed


def describe_validation_error(e: ValidationError) -> str:
    """One line per problem, each naming the field: `max_batch_size=0: Input should be >= 1`."""
    parts = []
    for err in e.errors(include_url=False):
        loc = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            parts.append(f"unknown arg {loc!r}")
        elif err["type"] == "missing":
            parts.append(f"missing required arg {loc!r}")
        elif loc:
            parts.append(f"{loc}={err.get('input')!r}: {err['msg']}")
        else:
            parts.append(err["msg"].removeprefix("Value error, "))
    return "; ".join(parts)
