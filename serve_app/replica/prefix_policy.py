"""The prefix router's decisions, without Ray: the engine's block hashes of a prompt, a per-replica
LRU of the blocks sent there, and the policy that picks a replica (serve_app/replica/prefix_routing.py
runs it inside Serve; docs/fleet.md explains it).

    choose(replicas, load, hashes, session, batch) -> RoutingDecision(replica, decision, reason)
    record(replica, hashes, session, batch)         once Serve reports the request routed there
    retain(alive)                                    when replicas come and go
"""
from __future__ import annotations

import hashlib
import random
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Hashable, List, Optional

from engine.core.block_manager import hash_block_tokens
from serve_app.replica.routing import DEFAULT_MAX_TRACKED_BATCHES, StickyTable

DEFAULT_MATCH_THRESHOLD = 0.1  # Ray's PrefixCacheAffinityRouter's match_rate_threshold
DEFAULT_IMBALANCE_BOUND = 32   # SGLang's cache-aware router's balance_abs_threshold
DEFAULT_MAX_TRACKED_BLOCKS = 65536  # per replica, when the engine's num_kv_blocks is not set


def prompt_block_hashes(token_ids: List[int], block_size: int, salt: str = "") -> List[int]:
    """The engine's chained hashes of the prompt's full blocks (BlockManager's, for the base
    model). A salt (a multiplexed model id) roots the chain elsewhere: that model's own names."""
    parent = int.from_bytes(hashlib.sha256(salt.encode()).digest(), "little") if salt else None
    hashes = []
    for end in range(block_size, len(token_ids) + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[end - block_size:end])
        hashes.append(parent)
    return hashes


class BlockLRU:
    """One replica's most recently routed block hashes, at most `capacity`."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def match_length(self, hashes: List[int]) -> int:
        """How many leading blocks of a prompt this replica was sent (a chained hash names its whole prefix)."""
        n = 0
        for h in hashes:
            if h not in self._blocks:
                break
            n += 1
        return n

    def insert(self, hashes: List[int]) -> None:
        # Tail first, so the head ends most recent and is dropped last: a later prompt sharing only
        # the beginning (a system prompt) still matches. The engine evicts a sequence's tail first too.
        for h in reversed(hashes):
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)


@dataclass(frozen=True)
class RoutingDecision:
    replica_id: Hashable  # the replica to try first
    decision: str         # "affinity" (what the replica holds decided) | "fallback" (load decided)
    reason: str           # affinity: session | prefix | batch; fallback: imbalanced | below_threshold | no_prefix


def rendezvous(key: str, replica_ids: List[Hashable]) -> Hashable:
    """The replica with the highest hash of (key, replica): every caller picks the same one, and
    removing another replica never moves the key."""
    def score(replica_id) -> bytes:
        name = str(getattr(replica_id, "unique_id", replica_id))
        return hashlib.sha256(f"{key}\0{name}".encode()).digest()
    return max(replica_ids, key=score)


class PrefixAffinityPolicy:
    """The router's decisions and tables, without Ray: replica ids are any hashable values and
    `queue_len(replica_id)` gives a replica's load (None: unknown, counted as empty)."""

    def __init__(self, match_threshold: float = DEFAULT_MATCH_THRESHOLD,
                 imbalance_bound: int = DEFAULT_IMBALANCE_BOUND,
                 max_tracked_blocks: int = DEFAULT_MAX_TRACKED_BLOCKS,
                 max_tracked_keys: int = DEFAULT_MAX_TRACKED_BATCHES):
        if not 0.0 <= match_threshold <= 1.0:
            raise ValueError(f"prefix_match_threshold={match_threshold} must lie in [0, 1]")
        if imbalance_bound < 0:
            raise ValueError(f"prefix_imbalance_bound={imbalance_bound} must be >= 0")
        if max_tracked_blocks < 1:
            raise ValueError(f"max_tracked_blocks={max_tracked_blocks} must be >= 1")
        self.match_threshold = match_threshold
        self.imbalance_bound = imbalance_bound
        self.max_tracked_blocks = max_tracked_blocks
        self.tables: dict[Hashable, BlockLRU] = {}
        self.sessions = StickyTable(max_tracked_keys)
        self.batches = StickyTable(max_tracked_keys)

    def choose(self, replica_ids: List[Hashable], queue_len: Callable[[Hashable], Optional[int]],
               hashes: List[int], session: str | None = None, batch: str | None = None) -> RoutingDecision:
        loads = {r: queue_len(r) or 0 for r in replica_ids}
        preferred = self._preferred(loads, hashes, session, batch)
        if preferred is not None:
            replica_id, reason = preferred
            if loads[replica_id] - min(loads.values()) <= self.imbalance_bound:
                return RoutingDecision(replica_id, "affinity", reason)
            return RoutingDecision(self._least_loaded(loads), "fallback", "imbalanced")
        return RoutingDecision(self._least_loaded(loads), "fallback", "below_threshold" if hashes else "no_prefix")

    def _preferred(self, loads: dict, hashes: List[int], session: str | None, batch: str | None):
        if session:
            replica_id = self.sessions.get(session)
            return (replica_id if replica_id in loads else rendezvous(session, list(loads))), "session"
        if hashes:
            matched = {r: self.tables[r].match_length(hashes) if r in self.tables else 0 for r in loads}
            best = max(matched.values())
            if best > 0 and best >= self.match_threshold * len(hashes):
                return min((r for r in loads if matched[r] == best), key=loads.__getitem__), "prefix"
        replica_id = self.batches.get(batch) if batch else None
        return (replica_id, "batch") if replica_id in loads else None

    def _least_loaded(self, loads: dict) -> Hashable:
        shuffled = random.sample(list(loads), len(loads))  # full ties broken at random
        return min(shuffled, key=lambda r: (loads[r], len(self.tables.get(r, ()))))

    def record(self, replica_id: Hashable, hashes: List[int], session: str | None = None,
               batch: str | None = None) -> None:
        """`replica_id` was sent this request: it will hold these blocks, and the session goes on
        there; a micro-batch keeps its first replica (note_batch)."""
        if hashes:
            self.tables.setdefault(replica_id, BlockLRU(self.max_tracked_blocks)).insert(hashes)
        if session:
            self.sessions.put(session, replica_id)
        if batch and self.batches.get(batch) is None:
            self.batches.put(batch, replica_id)

    def note_batch(self, batch: str, replica_id: Hashable, alive) -> None:
        """The batch's replica, unless it has one among `alive` already (its first decision sticks)."""
        if self.batches.get(batch) not in alive:
            self.batches.put(batch, replica_id)

    def retain(self, alive: set) -> None:
        """Forget the tables of replicas no longer running (sessions and batches re-decide when theirs is gone)."""
        for replica_id in [r for r in self.tables if r not in alive]:
            del self.tables[replica_id]
