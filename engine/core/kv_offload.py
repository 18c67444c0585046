"""A second KV tier: prefix-cache blocks evicted from the device pool, kept in host memory. No torch.

    device pool (BlockManager)                          host pool (HostBlockPool), LRU
    a cached block is handed out again (evicted)  ---->  its KV copied to a host block, under its hash
    a prompt's next block hashes are on the host  <----  copied into fresh device blocks: a cache hit

The block manager decides, the worker copies (engine/worker/host_kv_cache.py). Each step's copies
travel as block-id pairs in the SchedulerOutput and the ModelInput, to every TP rank, and run
before the step's forward, all swap-outs first:

    blocks_to_swap_out  [(device block, host block)]   the evicted block's old KV, before it is reused
    blocks_to_swap_in   [(host block, device block)]   a hit's KV, before the forward reads it

A swapped-in block is registered under its hash at once: a later request of the same step may hit
it too (its reads come after the copies). The host copy stays (the tier is inclusive), so a block
swapped in and evicted again costs no second copy. Within one step, a host block that a copy
reads or writes is never reused for another copy (swap-outs run first, and one destination must
not be written twice); when every host block is so taken, an evicted block is simply dropped.

Preemption needs nothing more: a preempted sequence's full blocks are freed into the prefix
cache with their hashes, go to the host when evicted, and come back as hits when it is
readmitted, so only its last, partial block is recomputed (swapping instead of recomputing).
Only full-attention pools are offloaded (a sliding window's freed blocks are never needed again).
"""
from __future__ import annotations

from collections import OrderedDict

from engine.core.block_manager import BlockManager
from engine.core.sequence import Sequence
from engine.errors import check_int


class HostBlockPool:
    """Host block ids by prefix hash, least recently used first, and the step's planned copies."""

    def __init__(self, num_blocks: int):
        check_int("num_host_blocks", num_blocks)
        self.num_blocks = num_blocks
        self.cached: OrderedDict[int, int] = OrderedDict()  # hash -> host block; front: evicted first
        self.free_ids: list[int] = list(range(num_blocks - 1, -1, -1))  # popped from the end: 0 first
        self._busy: set[int] = set()  # host blocks this step's copies read or write
        self._swap_out: list[tuple[int, int]] = []
        self._swap_in: dict[int, int] = {}  # device block -> host block (the last plan for a block wins)
        self.num_swapped_out = 0  # blocks, lifetime (metrics)
        self.num_swapped_in = 0

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self.cached

    def has_plan(self) -> bool:
        """Copies planned for the next step and not yet taken."""
        return bool(self._swap_out or self._swap_in)

    def clear(self) -> None:
        """Every host block free, no prefix kept (the lifetime counters stay)."""
        self.cached.clear()
        self.free_ids = list(range(self.num_blocks - 1, -1, -1))
        self._busy.clear()

    def store(self, device_block: int, block_hash: int) -> None:
        """Plan the copy of an evicted device block; a hash already here is only touched."""
        if block_hash in self.cached:
            self.cached.move_to_end(block_hash)
            return
        host_block = self._allocate()
        if host_block is None:
            return  # every host block is in this step's copies: this one is not kept
        self.cached[block_hash] = host_block
        self._busy.add(host_block)
        self._swap_out.append((device_block, host_block))
        self.num_swapped_out += 1

    def reserve(self, block_hash: int) -> None:
        """Keep the host block of `block_hash` (about to be loaded) from reuse until the plan is taken."""
        self.cached.move_to_end(block_hash)
        self._busy.add(self.cached[block_hash])

    def load(self, block_hash: int, device_block: int) -> None:
        """Plan the copy of the host block holding `block_hash` (reserved) into `device_block`."""
        host_block = self.cached[block_hash]
        self._swap_in[device_block] = host_block
        self.num_swapped_in += 1

    def take_plan(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """(blocks_to_swap_out, blocks_to_swap_in) planned since the last call; the step's start."""
        plan = self._swap_out, [(h, d) for d, h in self._swap_in.items()]
        self._swap_out, self._swap_in, self._busy = [], {}, set()
        return plan

    def _allocate(self) -> int | None:
        if self.free_ids:
            return self.free_ids.pop()
        for block_hash, host_block in self.cached.items():  # least recently used that no copy touches
            if host_block not in self._busy:
                del self.cached[block_hash]
                return host_block
        return None

    def check_invariants(self) -> None:
        """Every host block is free or holds exactly one hash; planned copies use distinct blocks."""
        held = list(self.cached.values())
        assert len(set(held)) == len(held) and not set(held) & set(self.free_ids), (held, self.free_ids)
        assert len(held) + len(self.free_ids) == self.num_blocks
        destinations = [h for _, h in self._swap_out]
        assert len(set(destinations)) == len(destinations), destinations


class OffloadingBlockManager(BlockManager):
    """A full-attention BlockManager with a host tier behind its prefix cache (`kv_offload_gb`)."""

    def __init__(self, num_blocks: int, block_size: int, num_host_blocks: int, group: int = 0):
        super().__init__(num_blocks, block_size, enable_prefix_caching=True, group=group)
        self.host = HostBlockPool(num_host_blocks)
        self.num_host_hit_tokens = 0  # of num_hit_tokens, those copied back from the host (lifetime)

    def reset_prefix_cache(self) -> bool:
        """The device pool's reset, and the host tier's prefixes forgotten with it."""
        if self.host.has_plan() or not super().reset_prefix_cache():
            return False
        self.host.clear()
        return True

    def take_swaps(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        return self.host.take_plan()

    def _is_cached(self, block_hash: int) -> bool:
        return block_hash in self.cached_block_ids or block_hash in self.host

    def _hit_block_ids(self, seq: Sequence, num_computed_from_cache: int) -> list[int | None]:
        """The device block of each hit, None for one held in the host tier only."""
        hashes = seq.block_hashes[:num_computed_from_cache // self.block_size]
        return [self.cached_block_ids.get(h) for h in hashes]

    def _take_hit_blocks(self, seq: Sequence, hit_ids: list[int | None]) -> list[int]:
        """Device hits are taken first and host hits reserved, so that popping blocks for the host
        hits (which evicts, and so stores to the host) never drops another hit of this sequence."""
        super()._take_hit_blocks(seq, [b for b in hit_ids if b is not None])
        host_hits = [i for i, b in enumerate(hit_ids) if b is None]
        for i in host_hits:
            self.host.reserve(seq.block_hashes[i])
        table = list(hit_ids)
        for i in host_hits:
            block_hash = seq.block_hashes[i]
            block_id = self._pop_free_block()
            self.block_hashes[block_id] = block_hash
            self.cached_block_ids[block_hash] = block_id
            self.host.load(block_hash, block_id)
            table[i] = block_id
        self.num_host_hit_tokens += len(host_hits) * self.block_size
        return table

    def _on_evict(self, block_id: int, block_hash: int) -> None:
        self.host.store(block_id, block_hash)

    def check_invariants(self, live_seqs: list[Sequence]) -> None:
        super().check_invariants(live_seqs)
        self.host.check_invariants()


def offload_stats(bm) -> dict[str, float]:
    """The host tier's counters for the engine's stats (0 without a tier): blocks copied out and
    back in (lifetime), tokens of prefix-cache hits that came from the host, its usage."""
    if not isinstance(bm, OffloadingBlockManager):
        return {"kv_offload_blocks_out": 0, "kv_offload_blocks_in": 0, "prefix_cache_host_hits": 0,
                "host_kv_cache_usage": 0.0}
    host = bm.host
    return {"kv_offload_blocks_out": host.num_swapped_out, "kv_offload_blocks_in": host.num_swapped_in,
            "prefix_cache_host_hits": bm.num_host_hit_tokens, "host_kv_cache_usage": len(host.cached) / host.num_blocks}
