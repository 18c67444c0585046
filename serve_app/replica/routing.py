"""BatchAffinityRouter: one routing decision per Ingress micro-batch.

The Ingress tags every engine request of a micro-batch with the batch's id (the handle's
`session_id`). This router, which runs inside the caller (Ingress / Guardrails replica),
picks an engine replica once per batch id, the least loaded by its cached queue lengths,
and sends the rest of the batch to the same replica. That is one decision instead of
one power-of-two probe per request, and batch-mates (which often share a system
prompt) meet in the same prefix cache. A request without a batch id, or whose batch
replica is full or gone, falls back to the power of two choices.

Only Serve's public request-router API is used (`ray.serve.request_router`).

Both our routers count their decisions (RouterMetrics: `router_requests`, in the caller's
replica): "affinity" when a request went where its batch, session or prefix points, "fallback"
when load decided, each with its reason (docs/fleet.md).
"""
from __future__ import annotations

import logging
import random
from collections import OrderedDict
from typing import List, Optional

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

from serve_app.metrics import Factory, _Series, ray_metric

logger = logging.getLogger(f"ray.serve.{__name__}")  # under Serve's logger: in the replica logs
DEFAULT_MAX_TRACKED_BATCHES = 4096


class StickyTable:
    """Batch id -> replica id, the most recent `capacity` batches (LRU). Pure: tested without Ray."""

    def __init__(self, capacity: int = DEFAULT_MAX_TRACKED_BATCHES):
        self.capacity = capacity
        self._table: OrderedDict[str, ReplicaID] = OrderedDict()

    def get(self, key: str) -> Optional[ReplicaID]:
        replica_id = self._table.get(key)
        if replica_id is not None:
            self._table.move_to_end(key)
        return replica_id

    def put(self, key: str, replica_id: ReplicaID) -> None:
        self._table[key] = replica_id
        self._table.move_to_end(key)
        while len(self._table) > self.capacity:
            self._table.popitem(last=False)


class RouterMetrics:
    """A router's decisions, in the series of the replica it runs in (an Ingress or Guardrails);
    `target`: the deployment it routes to (EngineDeployment, Guardrails)."""

    def __init__(self, prefix: str, model_name: str, target: str, factory: Factory = ray_metric):
        self.requests = _Series(prefix, model_name, factory).make(
            "counter", "router_requests", "Requests routed to the target deployment, by decision: affinity "
            "(reason: the batch, session or prefix the replica holds) or fallback (reason: why load decided).",
            ("target", "decision", "reason"))
        self.target = target

    def count(self, decision: str, reason: str) -> None:
        self.requests.inc(1, tags={"target": self.target, "decision": decision, "reason": reason})


def least_loaded(candidates: List[RunningReplica], queue_len) -> RunningReplica:
    """The candidate with the shortest known queue (unknown counts as empty); ties broken at random."""
    shuffled = random.sample(candidates, len(candidates))
    return min(shuffled, key=lambda r: queue_len(r.replica_id) or 0)


class BatchAffinityRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, max_tracked_batches: int = DEFAULT_MAX_TRACKED_BATCHES, metrics_prefix: str = "rayllm",
                         model_name: str = "", **kwargs) -> None:
        self._sticky = StickyTable(max_tracked_batches)
        self._metrics = RouterMetrics(metrics_prefix, model_name, self._deployment_id.name)
        logger.info("batch-affinity routing to %s", self._deployment_id)

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        if not candidate_replicas:
            return []
        fallback = [_power_of_two(candidate_replicas)]
        key = pending_request.metadata.session_id if pending_request is not None else ""
        if not key:
            return fallback
        chosen = self.sticky.get(key)
        replica = self.curr_replicas.get(chosen) if chosen is not None else None
        if replica is None:  # the batch's one decision (or its replica is gone: decide again)
            replica = least_loaded(candidate_replicas, self.replica_queue_len_cache.get)
            self.sticky.put(key, replica.replica_id)
        return [[replica]] + fallback  # the batch's replica first; if it is full, power of two

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        metrics = getattr(self, "_metrics", None)
        if metrics is None:
            return
        key = pending_request.metadata.session_id
        if not key:
            metrics.count("fallback", "no_batch")  # a request alone in its micro-batch: power of two
        elif self.sticky.get(key) == replica_id:
            metrics.count("affinity", "batch")
        else:
            # Its batch's replica was full or gone, or (FIFOMixin) a replica chosen for another
            # pending request came to it first.
            metrics.count("fallback", "other_replica")

    @property
    def sticky(self) -> StickyTable:
        if not hasattr(self, "_sticky"):  # initialize_state not called (no kwargs configured)
            self._sticky = StickyTable()
        return self._sticky


def _power_of_two(candidates: List[RunningReplica]) -> List[RunningReplica]:
    return random.sample(candidates, min(2, len(candidates)))
