"""PrefixAffinityRouter: each engine request to the replica most likely to hold its prompt's prefix.

A conversation's turns and an agent's calls share long prefixes (system prompt, tool schemas,
history). Spread over replicas at random, each replica recomputes prefixes another one holds.
This router runs in the caller's process (Ingress / Guardrails replica) and keeps, per engine
replica, an approximate LRU of the prompt blocks it sent there, named as the engine names them:
the chained block hashes of engine/core/block_manager.py (`hash_block_tokens`, the engine's
block size, full blocks only). It hashes the request's prompt token ids, which the Ingress made
and which the router reads off the request object in its own process: nothing extra travels.
A request goes, in this order, to:

    1. its session's replica (X-Session-ID header, or OpenAI `prompt_cache_key` / `user`): where
       this router sent the session before, else its rendezvous-hash replica (the same
       replica from every caller, with no shared state)                           affinity "session"
    2. the replica holding the longest prefix of its blocks, if that covers at least
       `match_threshold` of them (ties: the least loaded)                         affinity "prefix"
    3. the replica of its Ingress micro-batch (as BatchAffinityRouter)            affinity "batch"
    4. the least loaded (ties: the one holding fewest blocks)    fallback "below_threshold" | "no_prefix"

Load is Serve's queue-length cache (ongoing requests per replica) plus this router's decisions not
yet routed (a micro-batch is decided before any of it is sent). A pick of 1-3 whose queue is
longer than the shortest by more than `imbalance_bound` gives way to 4 (fallback "imbalanced").
If the pick is full, Serve tries the others, least loaded first; Serve also hands a chosen
replica to the oldest pending request (FIFOMixin), which is the one it was chosen for unless
routing tasks interleave: either way the request is counted fallback "other_replica". So the
tables learn where a request went once its replica accepted it (`on_request_routed`), never
where it was meant to go; only a micro-batch's replica is noted at the choice, for its mates.
(FIFOMixin all the same: without it Serve matches a replica to the request by internal request
id, which the k engine requests of one k-prompt completion share: all but one would never go.)

A multiplexed request (a LoRA adapter) is first narrowed to the replicas holding its model
(Serve's MultiplexMixin), and its hashes are salted with the model id: the engine hashes an
adapter's blocks with the adapter's id, so no other model's blocks are of use to it.
"""
from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Callable, List, Optional

from ray.serve.request_router import (FIFOMixin, MultiplexMixin, PendingRequest, ReplicaID, RequestRouter,
                                      RunningReplica)

from serve_app.replica.prefix_policy import (DEFAULT_IMBALANCE_BOUND, DEFAULT_MATCH_THRESHOLD,
                                             DEFAULT_MAX_TRACKED_BLOCKS, PrefixAffinityPolicy, RoutingDecision,
                                             prompt_block_hashes)
from serve_app.replica.routing import RouterMetrics

logger = logging.getLogger(f"ray.serve.{__name__}")  # under Serve's logger: in the replica logs

_MAX_PENDING = 4096  # decisions awaiting on_request_routed (a request cancelled while routed never gets it)
_DECISION_TTL_S = 10.0  # a decision still unrouted after this long is dropped (Serve's queue-length cache TTL)


@dataclass
class _Routing:
    """One engine request being routed: what the policy needs of it, and its latest decision."""

    request: PendingRequest  # held, so that its id() is not reused while this entry lives
    hashes: List[int]
    session: str | None
    batch: str | None
    created: float = field(default_factory=time.monotonic)
    decision: RoutingDecision | None = None


def _routing_of(pending_request: Optional[PendingRequest], block_size: int) -> Optional[_Routing]:
    """What routing needs of a generate call (its EngineRequest); None for other calls."""
    if pending_request is None or not pending_request.args:
        return None
    request = pending_request.args[0]
    token_ids = getattr(request, "prompt_token_ids", None)
    if token_ids is None:  # model_info, check_health: nothing to match
        return None
    metadata = pending_request.metadata
    return _Routing(pending_request, prompt_block_hashes(token_ids, block_size, metadata.multiplexed_model_id),
                    getattr(request, "session", None), metadata.session_id or None)


class PrefixAffinityRouter(FIFOMixin, MultiplexMixin, RequestRouter):
    def initialize_state(self, block_size: int = 16, prefix_match_threshold: float = DEFAULT_MATCH_THRESHOLD,
                         prefix_imbalance_bound: int = DEFAULT_IMBALANCE_BOUND,
                         max_tracked_blocks: int = DEFAULT_MAX_TRACKED_BLOCKS, metrics_prefix: str = "rayllm",
                         model_name: str = "", **kwargs) -> None:
        self._block_size = block_size
        self._policy = PrefixAffinityPolicy(prefix_match_threshold, prefix_imbalance_bound, max_tracked_blocks)
        self._pending: OrderedDict[int, _Routing] = OrderedDict()  # id(PendingRequest) -> its routing
        self._metrics = RouterMetrics(metrics_prefix, model_name, self._deployment_id.name)
        logger.info("prefix-affinity routing to %s: block_size=%d threshold=%s imbalance_bound=%d",
                    self._deployment_id, block_size, prefix_match_threshold, prefix_imbalance_bound)

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        if pending_request is not None and pending_request.metadata.multiplexed_model_id:
            held = self.apply_multiplex_routing(pending_request)  # the model's replicas first, then any
            candidate_replicas = [r for r in candidate_replicas if r.replica_id in held]
        if not candidate_replicas:
            return []
        by_id = {r.replica_id: r for r in candidate_replicas}
        routing = self._routing(pending_request)
        queue_len = self._load_function(routing)
        if routing is None:  # not a generate call (model_info, check_health): load alone
            return [sorted(candidate_replicas, key=lambda r: queue_len(r.replica_id))]
        decision = self._policy.choose(list(by_id), queue_len, routing.hashes, routing.session, routing.batch)
        if routing.batch:  # now, not once routed: its batch-mates are being routed at the same moment
            self._policy.note_batch(routing.batch, decision.replica_id, by_id)
        routing.decision = decision
        rest = sorted((r for r in candidate_replicas if r.replica_id != decision.replica_id),
                      key=lambda r: queue_len(r.replica_id))
        return [[by_id[decision.replica_id]], rest] if rest else [[by_id[decision.replica_id]]]

    def _load_function(self, routing: Optional[_Routing]) -> Callable[[ReplicaID], int]:
        """Ongoing requests per replica as Serve's cache has them, plus this router's decisions not
        yet routed: a burst is routed before any of it is sent, and would all see the same loads."""
        cutoff = time.monotonic() - _DECISION_TTL_S
        while self._pending and next(iter(self._pending.values())).created < cutoff:
            self._pending.popitem(last=False)  # cancelled while being routed, or routed for too long
        deciding = Counter(p.decision.replica_id for p in self._pending.values()
                           if p.decision is not None and p is not routing)
        cache = self.replica_queue_len_cache
        return lambda replica_id: (cache.get(replica_id) or 0) + deciding[replica_id]

    def _routing(self, pending_request: Optional[PendingRequest]) -> Optional[_Routing]:
        """The request's routing entry, made at its first attempt (retries reuse its hashes)."""
        routing = self._pending.get(id(pending_request))
        if routing is not None and routing.request is pending_request:
            return routing
        routing = _routing_of(pending_request, self._block_size)
        if routing is not None:
            self._pending.pop(id(pending_request), None)  # a dead request's entry under a reused id
            self._pending[id(pending_request)] = routing  # at the end: entries stay in creation order
            while len(self._pending) > _MAX_PENDING:
                self._pending.popitem(last=False)
        return routing

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        """The replica accepted the request: the tables learn where it went (only now: under FIFOMixin
        a replica chosen for one request may go to another)."""
        routing = self._routing(pending_request)  # made here if no routing attempt was its own
        self._pending.pop(id(pending_request), None)
        if routing is None:
            return
        self._policy.record(replica_id, routing.hashes, routing.session, routing.batch)
        decision = routing.decision
        if decision is not None and replica_id == decision.replica_id:
            self._metrics.count(decision.decision, decision.reason)
        else:  # its pick was full, or it got a replica chosen for another request
            self._metrics.count("fallback", "other_replica")

    def update_replicas(self, replicas: List[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._policy.retain({r.replica_id for r in replicas})

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._policy.retain(set(self.curr_replicas))
