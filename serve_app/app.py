"""`build_app(args)`: the Serve application, assembled with `.bind()`.

    Ingress (FastAPI, @serve.batch) --+--------------------------------> EngineDeployment (autoscaled)
                                      +--> Guardrails (JSON requests) --^

    colocate_ingress: one deployment, each replica an Ingress that runs its own engine (engine
    process + JSON guard in its process), autoscaled as the engine was. The Ingress is handed a
    LocalEngineFactory (serve_app/replica/client.py) in place of the two handles.

    serve run deploy/config.yaml
    serve run serve_app.app:build_app model=models/tiny-llama device=cpu dtype=float32
"""
from __future__ import annotations

import logging
from typing import Any

from ray import serve

from serve_app.args import AppArgs, resolve_app_args
from serve_app.guard.guardrails import Guardrails
from serve_app.http.ingress import Ingress
from serve_app.replica.client import LocalEngineFactory
from serve_app.replica.engine_deployment import EngineDeployment
from serve_app.replica.placement import check_gpus, engine_placement, resolve_device
from serve_app.replica.prefix_policy import DEFAULT_MAX_TRACKED_BLOCKS

logger = logging.getLogger(f"ray.serve.{__name__}")  # under Serve's logger: in the replica logs

BATCH_AFFINITY_ROUTER = "serve_app.replica.routing.BatchAffinityRouter"
PREFIX_AFFINITY_ROUTER = "serve_app.replica.prefix_routing.PrefixAffinityRouter"


def build_app(args: dict[str, Any]) -> serve.Application:
    """Validate `args` (a bad one raises ValueError naming it) and bind the deployments: three, or
    with colocate_ingress one Ingress that starts its engine itself."""
    a = resolve_app_args(args)
    device = resolve_device(a.device)
    check_gpus(device, a.tensor_parallel_size)
    if a.colocate_ingress:
        return Ingress.options(**colocated_options(a, device)).bind(None, None, a, LocalEngineFactory(a, device))
    engine = EngineDeployment.options(**engine_options(a, device)).bind(a, device)
    guardrails = Guardrails.options(
        num_replicas=a.ingress_replicas, max_ongoing_requests=a.ingress_max_ongoing_requests,
        ray_actor_options={"num_cpus": 0}, **shutdown_options(a), **router_options(a, engine=False),
    ).bind(engine, a.guardrails)
    return Ingress.options(**ingress_options(a)).bind(engine, guardrails, a)


def deployment_names(a: AppArgs) -> set[str]:
    """The deployments build_app binds for these args: what a Serve config may configure."""
    if a.colocate_ingress:
        return {Ingress.name}
    return {Ingress.name, Guardrails.name, EngineDeployment.name}


def engine_options(a: AppArgs, device: str) -> dict[str, Any]:
    return {
        "autoscaling_config": a.autoscaling_config(),
        # Ongoing requests per replica: enough to fill the engine's batch (max_num_seqs) with a queue behind it.
        "max_ongoing_requests": a.engine_max_ongoing_requests or 2 * a.max_num_seqs,
        "max_queued_requests": a.max_queued_requests,
        "user_config": a.streaming().model_dump(),
        "health_check_period_s": a.health_check_period_s,
        "health_check_timeout_s": a.health_check_timeout_s,
        **shutdown_options(a),
        **engine_placement(device, a.tensor_parallel_size, a.engine_num_cpus),
        **router_options(a),
    }


def colocated_options(a: AppArgs, device: str) -> dict[str, Any]:
    """The engine replica's options for an Ingress that runs the engine: its placement, autoscaling,
    health checks; the live knobs of both (user_config); ongoing requests enough for either."""
    options = {k: v for k, v in engine_options(a, device).items() if k != "request_router_config"}
    options["max_ongoing_requests"] = max(options["max_ongoing_requests"], a.ingress_max_ongoing_requests,
                                          2 * a.max_batch_size)
    options["user_config"] = {**a.batching().model_dump(), **a.streaming().model_dump()}
    return options


def shutdown_options(a: AppArgs) -> dict[str, Any]:
    """How every deployment's replicas stop: drained for up to graceful_shutdown_timeout_s."""
    return {"graceful_shutdown_timeout_s": a.graceful_shutdown_timeout_s,
            "graceful_shutdown_wait_loop_s": a.graceful_shutdown_wait_loop_s}


def router_options(a: AppArgs, engine: bool = True) -> dict[str, Any]:
    """How callers pick a replica of a deployment (the router runs in the caller's process). Prefix
    affinity is for the engine replicas, whose KV caches it follows; Guardrails replicas hold no
    cache, and keep one replica per micro-batch."""
    metrics = {"metrics_prefix": a.metrics_prefix, "model_name": a.model_name}
    if a.request_router == "prefix_affinity" and engine:
        kwargs = {"block_size": a.block_size, "prefix_match_threshold": a.prefix_match_threshold,
                  "prefix_imbalance_bound": a.prefix_imbalance_bound,
                  "max_tracked_blocks": a.num_kv_blocks or DEFAULT_MAX_TRACKED_BLOCKS, **metrics}
        return {"request_router_config": {"request_router_class": PREFIX_AFFINITY_ROUTER,
                                           "request_router_kwargs": kwargs}}
    if a.request_router in ("batch_affinity", "prefix_affinity"):
        return {"request_router_config": {"request_router_class": BATCH_AFFINITY_ROUTER,
                                          "request_router_kwargs": metrics}}
    return {}


def ingress_options(a: AppArgs) -> dict[str, Any]:
    # Serve caps a replica's concurrent requests (and so the batch) at max_ongoing_requests, and
    # streams hold their slot until the last token: keep it well above max_batch_size.
    max_ongoing = max(a.ingress_max_ongoing_requests, 2 * a.max_batch_size)
    return {
        "num_replicas": a.ingress_replicas,
        "max_ongoing_requests": max_ongoing,
        "user_config": a.batching().model_dump(),
        "ray_actor_options": {"num_cpus": 0},
        **shutdown_options(a),
    }
