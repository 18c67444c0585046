"""The application's arguments: validated once, at `build_app`, with errors that name the bad arg.

They come from `deploy/config.yaml` (`applications[].args`) or from the command line
(`serve run serve_app.app:build_app model=... max_batch_size=8`), where every value
arrives as a string: pydantic's lax mode turns "8" into 8 and "true" into True.

One declaration per knob: the engine's are `EngineConfig`'s fields (engine/config/engine.py), taken
here by name, type and default; the live knobs' initial values are `BatchingConfig`'s and
`StreamingConfig`'s fields below. `AppArgs` declares only what is the app's own.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import types
import typing
from typing import Annotated, Any, Literal

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, create_model,
                      field_validator, model_validator)

from engine.config import DEVICES, EngineConfig, ModelConfig
from engine.entrypoints.tool_parsers import get_tool_parser
from serve_app.guard.policy import GuardrailPolicy
from serve_app.lora.adapters import check_lora_modules, parse_lora_modules

STREAM_INTERVAL_MS = 20.0
MAX_STREAM_INTERVAL_MS = 1000.0
# Streamed items per second per engine replica (all its streams together) when
# max_stream_messages_per_s is not set. Every item costs CPU in each process it crosses (engine
# replica, Ingress, proxy, client: per process in docs/benchmarks.md, "Serving overhead"). On a CPU
# node those processes share the cores with the engine, so the budget is small; on a GPU node
# they have cores of their own and one Ingress replica handles a few thousand items a second.
DEFAULT_STREAM_MESSAGES_PER_S = {"cpu": 200.0, "cuda": 2000.0}
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
    # Ingress and the proxy. The end, and everything up to the first text, is never held back.
    # 0: an item per engine step (per token when the replica keeps up). Measured: docs/benchmarks.md.
    stream_interval_ms: float = Field(STREAM_INTERVAL_MS, ge=0.0, le=MAX_STREAM_INTERVAL_MS)
    # Load-aware pacing: with S requests streaming on a replica, each waits at least
    # S / max_stream_messages_per_s between items, so the replica sends about that many items
    # a second however many requests it serves (capped at MAX_STREAM_INTERVAL_MS). At low load
    # stream_interval_ms rules. None: DEFAULT_STREAM_MESSAGES_PER_S for the replica's device;
    # 0: no budget (stream_interval_ms alone).
    max_stream_messages_per_s: float | None = Field(None, ge=0.0)

    def interval_s(self, num_streams: int, device: str) -> float:
        """How long a stream waits between two items while `num_streams` stream on its replica."""
        budget = self.max_stream_messages_per_s
        if budget is None:
            budget = DEFAULT_STREAM_MESSAGES_PER_S[device]
        interval_ms = self.stream_interval_ms
        if budget > 0:
            interval_ms = max(interval_ms, min(1000.0 * num_streams / budget, MAX_STREAM_INTERVAL_MS))
        return interval_ms / 1000.0


def _engine_fields() -> dict[str, Any]:
    """Every `EngineConfig` field as a pydantic field: its name, type and default, as the engine
    declares them. The values are checked by the engine itself (`EngineConfig.__post_init__`, run
    by `parse_app_args`), so a knob added to the engine is an app arg with no edit here."""
    hints = typing.get_type_hints(EngineConfig)
    fields = {}
    for f in dataclasses.fields(EngineConfig):
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = Field(default_factory=f.default_factory)
        else:
            default = ...
        hint = hints[f.name]
        if _takes_dict(hint):  # `serve run ... speculative_config='{"method": "ngram", ...}'`: JSON
            hint = Annotated[hint, BeforeValidator(_json_if_string)]
        fields[f.name] = (hint, default)
    return fields


def _takes_dict(hint) -> bool:
    members = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    return any((typing.get_origin(m) or m) is dict for m in members)


def _json_if_string(value: Any) -> Any:
    """A dict-valued engine knob given as text (a command line's `k=v`) is read as JSON."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise ValueError(f"expected a JSON object ({e.msg})") from None


def _fields_of(model: type[BaseModel]) -> dict[str, Any]:
    """A pydantic model's fields (default, bounds and all), to declare again in another model."""
    return {name: (info.annotation, info) for name, info in model.model_fields.items()}


# The args declared elsewhere, once: the engine's knobs (EngineConfig) and the initial values of
# the live knobs (BatchingConfig for the Ingress, StreamingConfig for the engine replica).
_DeclaredElsewhere = create_model(
    "_DeclaredElsewhere", __config__=ConfigDict(extra="forbid", protected_namespaces=()),
    **_engine_fields(), **_fields_of(BatchingConfig), **_fields_of(StreamingConfig))


class AppArgs(_DeclaredElsewhere):
    """The flat `args` of the app: every `EngineConfig` field, `BatchingConfig`'s and
    `StreamingConfig`'s fields, and the app's own below."""

    # -- engine fields the app treats differently from the engine --
    # Non-empty: "" would fail only where a replica loads it (check_model_at_build may be off).
    model: str = Field(min_length=1)
    # Checked here, not by the engine, which parse_app_args runs on "cpu": the node that builds
    # the app may lack the engine nodes' device. 'auto' is resolved from the Ray cluster's
    # resources at build_app (serve_app.replica.placement.resolve_device), not on a replica.
    device: Literal[("auto", *DEVICES)] = "auto"  # the engine's list of devices, checked here

    # -- the model as served --
    served_model_name: str | None = None  # None: the model path's last component
    # Check at build_app that the checkpoint exists and is supported. Turn off where the node
    # that builds the app (the head) cannot see the checkpoint that the engine nodes load.
    check_model_at_build: bool = True

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
    retry_after_s: int = Field(1, ge=0)
    engine_num_cpus: float = Field(1.0, ge=0.0)
    # torch threads of a CPU engine replica (split over its TP ranks). Ray sets OMP_NUM_THREADS
    # to the actor's num_cpus (1), which would make the served engine single-threaded
    # (docs/benchmarks.md, "engine offline vs AsyncLLM vs the served app"). None: every core the
    # replica may run on.
    engine_cpu_threads: int | None = Field(None, ge=1)
    # The engine's step loop in a process of its own (engine/entrypoints/core_client.py), out of the replica's
    # GIL, which Ray's request machinery shares and the step thread otherwise waits for
    # (docs/benchmarks.md, "the engine's step loop in its own process"). False: a thread of the replica.
    engine_process: bool = True
    # The Ingress in every engine replica's process, calling its engine directly, instead of
    # its own deployment reaching the engine replicas over a gRPC stream per request
    # (serve_app/http/ingress.py). The Ingress then scales with the engine (min/max_replicas) and
    # runs the JSON guardrails itself: no Ray hop per stream, for nodes whose CPUs are scarce;
    # not measured on a GPU yet (docs/benchmarks.md, today's figures). Off by default:
    # docs/serving.md, "One deployment instead of three".
    colocate_ingress: bool = False
    # "batch_affinity": one engine replica per Ingress micro-batch (serve_app.replica.routing);
    # "prefix_affinity": the replica most likely to hold the prompt's prefix in its KV cache, or the
    # session's (serve_app.replica.prefix_routing, docs/fleet.md); "power_of_two": Serve's default.
    request_router: Literal["batch_affinity", "prefix_affinity", "power_of_two"] = "batch_affinity"
    # prefix_affinity: the least loaded replica instead, when the best prefix match covers less than
    # this fraction of the prompt's full blocks (Ray's PrefixCacheAffinityRouter: 0.1) ...
    prefix_match_threshold: float = Field(0.1, ge=0.0, le=1.0)
    # ... or when the replica it points to has more ongoing requests than the least loaded by more
    # than this (SGLang's cache-aware router: 32).
    prefix_imbalance_bound: int = Field(32, ge=0)

    # -- replica lifecycle --
    health_check_period_s: float = Field(10.0, gt=0.0)
    health_check_timeout_s: float = Field(30.0, gt=0.0)
    graceful_shutdown_timeout_s: float = Field(20.0, ge=0.0)
    # How often a stopping replica checks that nothing is in flight (Serve's option; its default, 2 s,
    # made every stop wait 2 s even with nothing to drain: a scale-down, a redeploy, `serve delete`).
    graceful_shutdown_wait_loop_s: float = Field(0.5, gt=0.0)

    # -- the Guardrails deployment (JSON requests): its policy (serve_app.guard.policy) --
    guardrails: dict[str, Any] = Field(default_factory=dict)

    # -- the HTTP surface --
    api_key: str | None = None
    max_request_body_bytes: int = Field(2 * 1024 * 1024, ge=1024)
    metrics_prefix: str = "rayllm"
    # A request field that neither OpenAI nor vLLM defines: "reject" answers 400 naming it (OpenAI's
    # behaviour; a typo never passes silently), "ignore" drops it (clients that send extras of their
    # own). Fields the APIs define but this server does not do are refused either way.
    unknown_request_fields: Literal["reject", "ignore"] = "reject"
    # How tool calls are found in a completion's text for tool_choice "auto" (vLLM's --tool-call-parser):
    # "hermes" (Qwen2.5, Qwen3, Hermes), "llama3_json" (Llama 3.x), "mistral". None: "auto" is a 400;
    # "required" and a named tool need no parser (their calls are grammar-constrained).
    tool_call_parser: str | None = None

    # -- LoRA adapters (docs/lora.md, "Serving"); enable_lora and the max_*lora* knobs are the engine's --
    # Adapters served as models of these names: name -> PEFT adapter directory, or vLLM's forms
    # (`--lora-modules sql=/a/sql chat=/a/chat`, or JSON objects with name and path). Implies enable_lora.
    lora_modules: dict[str, str] = Field(default_factory=dict)
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING),
    # behind api_key; needs lora_adapter_dir and a single Ingress replica. Implies enable_lora.
    allow_runtime_lora_updating: bool = False
    # The directory runtime loads may read adapters from (symlinks and .. resolved; relative lora_paths
    # are taken from it).
    lora_adapter_dir: str | None = None

    @field_validator("lora_modules", mode="before")
    @classmethod
    def _parse_lora_modules(cls, value: Any) -> dict[str, str]:
        return parse_lora_modules(value)

    @model_validator(mode="after")
    def _check_lora(self) -> "AppArgs":
        wants_lora = bool(self.lora_modules) or self.allow_runtime_lora_updating
        if wants_lora and not self.enable_lora:
            if "enable_lora" in self.model_fields_set:
                raise ValueError("enable_lora=False contradicts lora_modules / allow_runtime_lora_updating")
            self.enable_lora = True
        if self.model_name in self.lora_modules:
            raise ValueError(f"lora_modules: adapter {self.model_name!r} has the base model's name")
        if self.allow_runtime_lora_updating:
            if not self.lora_adapter_dir:
                raise ValueError("allow_runtime_lora_updating needs lora_adapter_dir: the directory adapters "
                                 "may be loaded from")
            # The registry of runtime loads lives in the Ingress (serve_app/lora/registry.py): one replica.
            if self.ingress_replicas != 1 or (self.colocate_ingress and self.max_replicas != 1):
                raise ValueError("allow_runtime_lora_updating needs a single Ingress replica (ingress_replicas=1; "
                                 "with colocate_ingress, max_replicas=1): each Ingress holds its own registry")
        return self

    @model_validator(mode="after")
    def _check_relations(self) -> "AppArgs":
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas={self.min_replicas} must be <= max_replicas={self.max_replicas}")
        if self.initial_replicas is not None and not self.min_replicas <= self.initial_replicas <= self.max_replicas:
            raise ValueError(f"initial_replicas={self.initial_replicas} must lie in "
                             f"[min_replicas={self.min_replicas}, max_replicas={self.max_replicas}]")
        if not _METRIC_NAME.match(self.metrics_prefix):
            raise ValueError(f"metrics_prefix={self.metrics_prefix!r} is not a valid Prometheus name prefix")
        if self.colocate_ingress and self.ingress_replicas != 1:
            raise ValueError(f"ingress_replicas={self.ingress_replicas} cannot be set with colocate_ingress: "
                             "the Ingress runs in every engine replica (min_replicas/max_replicas)")
        if self.request_router == "prefix_affinity" and not self.enable_prefix_caching:
            raise ValueError("request_router='prefix_affinity' needs enable_prefix_caching=True: without a "
                             "prefix cache no replica holds a prefix")
        if self.request_router == "prefix_affinity" and self.colocate_ingress:
            raise ValueError("request_router='prefix_affinity' cannot be set with colocate_ingress: every Ingress "
                             "replica runs its own engine, so no router picks one (set colocate_ingress=false)")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty (leave it unset to serve without a key)")
        if self.tool_call_parser is not None:
            try:
                get_tool_parser(self.tool_call_parser)
            except ValueError as e:
                raise ValueError(f"tool_call_parser: {e}") from None
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
        """The EngineConfig for one replica on `device` (resolved from 'auto'); touches no disk."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(EngineConfig)}
        return EngineConfig(**{**values, "device": device})

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
        return StreamingConfig(**self.model_dump(include=set(StreamingConfig.model_fields)))

    def batching(self) -> BatchingConfig:
        return BatchingConfig(**self.model_dump(include=set(BatchingConfig.model_fields)))


def parse_app_args(args: dict[str, Any] | None) -> AppArgs:
    """Validate `args`; a bad one fails here, at start, with a message naming it."""
    try:
        parsed = AppArgs.model_validate(dict(args or {}))
        parsed.engine_config("cpu")  # the engine's own checks of its fields (block_size multiple of 8, ...)
    except ValidationError as e:
        raise ValueError("invalid application args: " + describe_validation_error(e)) from None
    except ValueError as e:
        raise ValueError(f"invalid application args: {e}") from None
    return parsed


def resolve_app_args(args: dict[str, Any] | None) -> AppArgs:
    """`parse_app_args`, then what needs the disk of the node that builds the app (`build_app`):
    relative model paths made absolute, and the checkpoint checked unless check_model_at_build=False."""
    a = _absolute_model_paths(parse_app_args(args))
    if a.check_model_at_build:
        check_model(a)
    return a


def check_model(a: AppArgs) -> None:
    """Fail at build time, naming the arg, when the checkpoint is missing or of an unsupported kind."""
    from engine.loader.model_path import resolve_model_path  # huggingface_hub: only where the app is built

    try:
        model_config = ModelConfig.from_pretrained(resolve_model_path(a.model))
        if a.tokenizer:
            resolve_model_path(a.tokenizer)
    except ValueError as e:
        raise ValueError(f"invalid application args: model={a.model!r}: {e}") from None
    try:
        check_lora_modules(a.lora_modules, a.max_lora_rank, model_config)
    except ValueError as e:
        raise ValueError(f"invalid application args: {e}") from None
    if a.lora_adapter_dir is not None and not os.path.isdir(a.lora_adapter_dir):
        raise ValueError(f"invalid application args: lora_adapter_dir={a.lora_adapter_dir!r} is not a directory")


def _absolute_model_paths(a: AppArgs) -> AppArgs:
    """`models/tiny-llama` means relative to where `serve run` was started, not to a worker's cwd."""
    updates = {}
    for name in ("model", "tokenizer", "lora_adapter_dir"):
        value = getattr(a, name)
        if value and not os.path.isabs(value) and os.path.isdir(value):
            updates[name] = os.path.abspath(value)
    modules = {name: os.path.abspath(path) if os.path.isdir(path) else path for name, path in a.lora_modules.items()}
    if modules != a.lora_modules:
        updates["lora_modules"] = modules
    if not updates:
        return a
    if a.served_model_name is None and "model" in updates:
        updates["served_model_name"] = a.model_name
    return a.model_copy(update=updates)

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
            parts.append(f"{loc}={err.get('input')!r}: {err['msg'].removeprefix('Value error, ')}")
        else:
            parts.append(err["msg"].removeprefix("Value error, "))
    return "; ".join(parts)
