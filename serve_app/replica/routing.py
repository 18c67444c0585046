"""BatchAffinityRouter: one routing decision per Ingress micro-batch.

The Ingress tags every engine request of a micro-batch with the batch's id (the handle's
`session_id`). This router, which runs inside the caller (Ingress / Guardrails replica),
picks an engine replica once per batch id, the least loaded by its cached queue lengths,
and sends the rest of the batch to the same replica. That is one decision instead of
one power-of-two probe per request, and batch-mates (which often share a system
prompt) meet in the same prefix cache. A request without a batch id, or whose batch
replica is full or gone, falls back to the power of two choices.

A request for a LoRA adapter (Serve's multiplexed model id) considers first the replicas that
hold it, then those holding the fewest adapters, then the rest (Serve's MultiplexMixin ranks, as
its default router uses them). An adapter no replica reports yet is placed once, on the least
loaded of those with the fewest, and its requests follow it there until the replica's report
arrives (a fraction of a second later, through the controller): requests for a new adapter that
come together load it on one replica, not on each.

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

from ray.serve.request_router import (FIFOMixin, MultiplexMixin, PendingRequest, ReplicaID, RequestRouter,
                                      RunningReplica)

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


class BatchAffinityRouter(FIFOMixin, MultiplexMixin, RequestRouter):
    def initialize_state(self, max_tracked_batches: int = DEFAULT_MAX_TRACKED_BATCHES, metrics_prefix: str = "rayllm",
                         model_name: str = "", **kwargs) -> None:
        self._sticky = StickyTable(max_tracked_batches)
        self._placed = StickyTable(max_tracked_batches)
        self._metrics = RouterMetrics(metrics_prefix, model_name, self._deployment_id.name)
        logger.info("batch-affinity routing to %s", self._deployment_id)

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        if not candidate_replicas:
            return []
        ranks = self._adapter_ranks(candidate_replicas, pending_request)
        fallback = [_power_of_two(rank) for rank in ranks]
        key = pending_request.metadata.session_id if pending_request is not None else ""
        if not key:
            return fallback
        chosen = self.sticky.get(key)
        replica = self.curr_replicas.get(chosen) if chosen is not None else None
        if replica is None:  # the batch's one decision (or its replica is gone: decide again)
            replica = least_loaded(ranks[0], self.replica_queue_len_cache.get)
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

    def _adapter_ranks(self, candidates: List[RunningReplica],
                       pending_request: Optional[PendingRequest]) -> List[List[RunningReplica]]:
        """The candidates in preference order: for an adapter, those holding it (or, while none reports
        it, the one it was placed on), then those with the fewest adapters, then the rest (empty ranks
        dropped); otherwise all of them as one rank."""
        model_id = pending_request.metadata.multiplexed_model_id if pending_request is not None else ""
        if not model_id:
            return [candidates]
        holders, fewest, rest = self.rank_replicas_via_multiplex(candidates, model_id)
        if not holders:
            placed = self.placed.get(model_id)
            if placed not in {r.replica_id for r in candidates}:
                placed = least_loaded(fewest or rest, self.replica_queue_len_cache.get).replica_id
                self.placed.put(model_id, placed)
            holders = [r for r in candidates if r.replica_id == placed]
            fewest, rest = ([r for r in rank if r.replica_id != placed] for rank in (fewest, rest))
        return [rank for rank in (holders, fewest, rest) if rank]

    @property
    def sticky(self) -> StickyTable:
        if not hasattr(self, "_sticky"):  # initialize_state not called (no kwargs configured)
            self._sticky = StickyTable()
        return self._sticky

    @property
    def placed(self) -> StickyTable:
        """Adapter (multiplexed model id) -> the replica it was sent to while no replica reported it."""
        if not hasattr(self, "_placed"):
            self._placed = StickyTable()
        return self._placed


def _power_of_two(candidates: List[RunningReplica]) -> List[RunningReplica]:
    return random.sample(candidates, min(2, len(candidates)))
