"""KV cache groups: which layers share one block pool and one block table per sequence. No torch.

A model whose layers all attend over the whole context (or all over one window) has one
group, and one `BlockManager`, exactly as before groups existed. A model that mixes full and
sliding layers (Gemma 2 / 3, gpt-oss, Qwen2 with `max_window_layers`) has two:

    group 0: the full-attention layers   every block of a sequence, as long as it lives
    group 1: the sliding layers          the blocks of its last window only (freed behind it)

Each group has its own cache tensors (`num_block_ids` rows per layer), its own pool and its
own table per sequence (`seq.block_tables[group]`); `HybridBlockManager` keeps the pools in
step: a sequence is admitted, grows, is preempted and is freed in every group at once.

`num_kv_blocks` names group 0's pool (the full group's, or the only group's), which bounds how
long a context fits; a sliding group of a hybrid model gets what its running sequences can
hold at most (`sliding_pool_blocks`: every sequence's window, and one step's chunk once),
capped at `num_kv_blocks`.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.core.block_manager import BlockManager
from engine.core.kv_offload import OffloadingBlockManager
from engine.core.sequence import Sequence
from engine.math_utils import cdiv


@dataclass(frozen=True)
class KVCacheGroup:
    layer_indices: tuple[int, ...]   # the attention layers whose KV this group holds
    sliding_window: int | None       # None: full attention


def kv_cache_groups(layer_types: list[str] | None, sliding_window: int | None,
                    num_layers: int) -> list[KVCacheGroup]:
    """Full layers first (group 0), then sliding ones; a single group when all are alike."""
    types = layer_types or ["full_attention"] * num_layers
    full = tuple(i for i, t in enumerate(types) if t != "sliding_attention")
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    groups = [KVCacheGroup(full, None)] if full else []
    if sliding:
        groups.append(KVCacheGroup(sliding, sliding_window))
    return groups


def sliding_blocks_per_seq(sliding_window: int, max_num_batched_tokens: int, block_size: int) -> int:
    """Most blocks a sliding pool holds for one sequence: a chunk of up to
    max_num_batched_tokens rows, the first of which sees W - 1 keys before it, plus one
    block of misalignment at the start."""
    return cdiv(sliding_window - 1 + max_num_batched_tokens, block_size) + 1


def sliding_pool_blocks(sliding_window: int, max_num_seqs: int, max_num_batched_tokens: int,
                        block_size: int) -> int:
    """Most blocks a sliding pool holds for every running sequence at once. A sequence s with n_s
    new rows this step holds cdiv(W - 1 + n_s, bs) + 1 <= cdiv(W - 1, bs) + 2 + n_s / bs blocks,
    and a step's rows sum to max_num_batched_tokens at most: only one step's chunk is counted
    once, not once per sequence (max_num_seqs * sliding_blocks_per_seq would reserve a whole
    chunk for each)."""
    return max_num_seqs * (cdiv(sliding_window - 1, block_size) + 2) + cdiv(max_num_batched_tokens, block_size)


def group_num_blocks(groups: list[KVCacheGroup], num_kv_blocks: int, max_num_seqs: int,
                     max_num_batched_tokens: int, block_size: int) -> list[int]:
    """Usable blocks of each group's pool, given group 0's (`num_kv_blocks`)."""
    out = [num_kv_blocks]
    for g in groups[1:]:
        need = sliding_pool_blocks(g.sliding_window, max_num_seqs, max_num_batched_tokens, block_size)
        out.append(min(num_kv_blocks, need))
    return out


def split_kv_budget(groups: list[KVCacheGroup], budget_bytes: int, bytes_per_layer_block: int,
                    max_num_seqs: int, max_num_batched_tokens: int, block_size: int) -> int:
    """`num_kv_blocks` (group 0's usable blocks) that a memory budget affords once every
    group's tensors are paid for (a sliding pool has one more row: its null block)."""
    cost0 = len(groups[0].layer_indices) * bytes_per_layer_block
    null0 = groups[0].sliding_window is not None
    if len(groups) == 1:
        return budget_bytes // cost0 - null0
    cost1 = len(groups[1].layer_indices) * bytes_per_layer_block
    need1 = group_num_blocks(groups, 1 << 62, max_num_seqs, max_num_batched_tokens, block_size)[1]
    n = (budget_bytes - (need1 + 1) * cost1) // cost0
    if n >= need1:
        return n
    # Too small for every sequence's window: both pools get the same count.
    return (budget_bytes - cost1) // (cost0 + cost1)


def make_block_manager(groups: list[KVCacheGroup], num_kv_blocks: int, block_size: int,
                       enable_prefix_caching: bool, max_num_seqs: int,
                       max_num_batched_tokens: int, num_host_blocks: int = 0) -> BlockManager | HybridBlockManager:
    """One BlockManager for one group (today's path), a HybridBlockManager for two; with host
    blocks (kv_offload_gb), an OffloadingBlockManager (one full-attention group, prefix caching on:
    EngineConfig refuses the rest)."""
    if num_host_blocks:
        assert len(groups) == 1 and groups[0].sliding_window is None and enable_prefix_caching, groups
        return OffloadingBlockManager(num_kv_blocks, block_size, num_host_blocks)
    sizes = group_num_blocks(groups, num_kv_blocks, max_num_seqs, max_num_batched_tokens, block_size)
    pools = [BlockManager(n, block_size, enable_prefix_caching, sliding_window=g.sliding_window, group=i)
             for i, (g, n) in enumerate(zip(groups, sizes))]
    return pools[0] if len(pools) == 1 else HybridBlockManager(pools)


class HybridBlockManager:
    """BlockManager's interface over one pool per KV cache group; pools[0] is the full group.

    Prefix hits: the full pool's hit is a prefix length L; the sliding pool's rule then picks
    the longest block-aligned P <= L whose last window before P it still holds. Prefix-cache
    counters and `num_blocks` are the full pool's; `usage` is the fullest pool's.
    """

    def __init__(self, pools: list[BlockManager]):
        assert len({p.block_size for p in pools}) == 1 and pools[0].sliding_window is None
        self.pools = pools
        self.block_size = pools[0].block_size
        self.enable_prefix_caching = pools[0].enable_prefix_caching

    @property
    def num_blocks(self) -> int:
        return self.pools[0].num_blocks

    @property
    def usage(self) -> float:
        return max(p.usage for p in self.pools)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.pools[0].prefix_cache_hit_rate

    @property
    def num_queried_tokens(self) -> int:
        return self.pools[0].num_queried_tokens

    @property
    def num_hit_tokens(self) -> int:
        return self.pools[0].num_hit_tokens

    def get_num_free_blocks(self) -> int:
        return min(p.get_num_free_blocks() for p in self.pools)

    def blocks_needed(self, num_tokens: int, max_num_batched_tokens: int) -> list[tuple[int, int]]:
        """(blocks one sequence of `num_tokens` needs at most, pool size) per pool."""
        return [(_pool_need(p, num_tokens, max_num_batched_tokens), p.num_blocks) for p in self.pools]

    def get_computed_blocks(self, seq: Sequence) -> int:
        num_tokens = self.pools[0].get_computed_blocks(seq)
        for p in self.pools[1:]:
            num_tokens = p.get_computed_blocks(seq, max_num_tokens=num_tokens)
        return num_tokens

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, num_computed_from_cache: int = 0) -> bool:
        for p in self.pools:
            p.remove_skipped_blocks(seq)
        if any(p.num_blocks_to_allocate(seq, num_new_tokens, num_computed_from_cache) > p.get_num_free_blocks()
               for p in self.pools):
            return False
        computed = seq.num_computed_tokens
        for p in self.pools:
            seq.num_computed_tokens = computed  # each pool sees the admission as it was
            p.allocate_checked(seq, num_new_tokens, num_computed_from_cache)
        return True

    def share_prefix(self, src_seq: Sequence, dst_seq: Sequence) -> int:
        num_tokens = min(p.num_shareable_tokens(src_seq, dst_seq) for p in self.pools)
        for p in self.pools:
            dst_seq.num_computed_tokens = 0  # each pool sees the sibling as it was
            p.share_prefix(src_seq, dst_seq, num_tokens)
        return num_tokens

    def reset_prefix_cache(self) -> bool:
        """Every pool's (none while any pool has a block in use)."""
        if any(any(p.ref_counts) for p in self.pools):
            return False
        return all([p.reset_prefix_cache() for p in self.pools])

    def take_swaps(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        return [], []  # no host tier with a sliding pool (EngineConfig refuses it)

    def cache_full_blocks(self, seq: Sequence) -> None:
        for p in self.pools:
            p.cache_full_blocks(seq)

    def free_blocks_past(self, seq: Sequence, num_tokens: int) -> None:
        for p in self.pools:
            p.free_blocks_past(seq, num_tokens)

    def free(self, seq: Sequence) -> None:
        for p in self.pools:
            p.free(seq)

    def check_invariants(self, live_seqs: list[Sequence]) -> None:
        for p in self.pools:
            p.check_invariants(live_seqs)

    def check_no_leak(self) -> None:
        for p in self.pools:
            p.check_no_leak()


def blocks_needed(bm: BlockManager | HybridBlockManager, num_tokens: int,
                  max_num_batched_tokens: int) -> list[tuple[int, int]]:
    """(most blocks one sequence of `num_tokens` KV tokens holds, pool size) for each pool of `bm`."""
    if isinstance(bm, HybridBlockManager):
        return bm.blocks_needed(num_tokens, max_num_batched_tokens)
    return [(_pool_need(bm, num_tokens, max_num_batched_tokens), bm.num_blocks)]


def _pool_need(p: BlockManager, num_tokens: int, max_num_batched_tokens: int) -> int:
    need = cdiv(num_tokens, p.block_size)
    if p.sliding_window is not None:
        need = min(need, sliding_blocks_per_seq(p.sliding_window, max_num_batched_tokens, p.block_size))
    return need
