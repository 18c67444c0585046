"""BlockManager: exact block ids, ref counts, prefix-cache hits and LRU eviction order (block_size 4)."""
from __future__ import annotations

import pytest

from engine.core.block_manager import BlockManager, hash_block_tokens
from engine.sampling_params import SamplingParams
from engine.core.sequence import Sequence

BS = 4


def make_seq(token_ids, request_id="r") -> Sequence:
    return Sequence(request_id, list(token_ids), SamplingParams(max_tokens=8))


def admit(bm: BlockManager, seq: Sequence) -> int:
    """Admit `seq` whole (prefix-cache hit + the rest), as the scheduler does; returns the hit tokens."""
    num_cached = bm.get_computed_blocks(seq)
    assert bm.allocate_slots(seq, seq.num_tokens - num_cached, num_computed_from_cache=num_cached)
    return num_cached


def compute(bm: BlockManager, seq: Sequence) -> None:
    """Pretend the model ran over every allocated-but-uncomputed token."""
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)


def test_allocation_ids_and_ref_counts():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a, b = make_seq(range(10)), make_seq(range(100, 105))
    assert bm.allocate_slots(a, 10) and bm.allocate_slots(b, 5)
    assert a.block_table == [0, 1, 2] and b.block_table == [3, 4]
    assert bm.ref_counts == [1, 1, 1, 1, 1, 0, 0, 0]
    assert bm.get_num_free_blocks() == 3 and bm.usage == pytest.approx(5 / 8)
    # Growing into the partial block needs nothing; crossing a block boundary takes the next id.
    a.num_computed_tokens = 10
    assert bm.allocate_slots(a, 2) and a.block_table == [0, 1, 2]
    a.num_computed_tokens = 12
    assert bm.allocate_slots(a, 1) and a.block_table == [0, 1, 2, 5]
    bm.check_invariants([a, b])


def test_allocate_fails_without_change():
    bm = BlockManager(num_blocks=3, block_size=BS)
    a, b = make_seq(range(8)), make_seq(range(50, 58))
    assert bm.allocate_slots(a, 8)
    assert not bm.allocate_slots(b, 8)  # needs 2, only 1 free
    assert b.block_table == [] and bm.get_num_free_blocks() == 1 and list(bm.free_block_ids) == [2]
    bm.check_invariants([a, b])


def test_free_order_uncached_blocks_reused_first():
    bm = BlockManager(num_blocks=6, block_size=BS, enable_prefix_caching=False)
    a = make_seq(range(10))
    admit(bm, a)
    compute(bm, a)
    bm.free(a)
    # Nothing cached: freed blocks go to the front, so the next request gets the same ids back.
    assert list(bm.free_block_ids) == [0, 1, 2, 3, 4, 5]
    bm.check_no_leak()


def test_prefix_hit_reuses_exact_blocks():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_seq(range(10))                      # [0 1 2 3][4 5 6 7][8 9]
    admit(bm, a)
    compute(bm, a)
    b = make_seq(list(range(8)) + [77, 78, 79])  # same two leading blocks
    assert admit(bm, b) == 8
    assert b.block_table == [0, 1, 3] and b.num_computed_tokens == 8
    assert bm.ref_counts[:4] == [2, 2, 1, 1]
    assert (bm.num_hit_tokens, bm.num_queried_tokens) == (8, 10 + 11)
    assert bm.prefix_cache_hit_rate == pytest.approx(8 / 21)
    bm.free(a)
    bm.free(b)
    bm.check_no_leak()


def test_partial_blocks_never_cached():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_seq(range(10))
    admit(bm, a)
    compute(bm, a)
    assert bm.block_hashes[2] is None and len(bm.cached_block_ids) == 2
    b = make_seq(range(11))  # shares a's partial block's tokens too, but only full blocks hit
    assert admit(bm, b) == 8 and b.block_table == [0, 1, 3]


def test_uncomputed_blocks_not_cached():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_seq(range(12))
    admit(bm, a)
    a.num_computed_tokens = 6  # a chunk: block 0 computed, block 1 only half
    bm.cache_full_blocks(a)
    assert list(bm.cached_block_ids.values()) == [0]
    assert bm.get_computed_blocks(make_seq(range(12))) == 4


@pytest.mark.parametrize("num_tokens, expected_hit", [(8, 4), (9, 8), (12, 8), (13, 12)])
def test_full_prompt_hit_leaves_one_token(num_tokens, expected_hit):
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_seq(range(16))
    admit(bm, a)
    compute(bm, a)
    b = make_seq(range(num_tokens))
    assert bm.get_computed_blocks(b) == expected_hit
    assert admit(bm, b) == expected_hit
    assert b.num_tokens - b.num_computed_tokens >= 1


def test_lru_eviction_tail_before_head_and_oldest_first():
    bm = BlockManager(num_blocks=7, block_size=BS)
    a, b = make_seq(range(12)), make_seq(range(100, 108))  # a: 3 full blocks, b: 2
    admit(bm, a)
    admit(bm, b)
    compute(bm, a)
    compute(bm, b)
    assert a.block_table == [0, 1, 2] and b.block_table == [3, 4]
    bm.free(a)
    bm.free(b)
    # Never-used blocks first, then a (freed first) tail-first, then b tail-first.
    assert list(bm.free_block_ids) == [5, 6, 2, 1, 0, 4, 3]
    assert bm.get_num_free_blocks() == 7  # cached blocks still count as free
    c = make_seq(range(200, 212))
    admit(bm, c)
    assert c.block_table == [5, 6, 2]  # evicts a's tail block only
    assert bm.block_hashes[2] is None and 2 not in bm.cached_block_ids.values()
    # a's head survived: a request sharing a's first 8 tokens still hits both blocks.
    d = make_seq(list(range(8)) + [9])
    assert admit(bm, d) == 8 and d.block_table == [0, 1, 4]  # the new block evicts b's tail
    assert list(bm.free_block_ids) == [3]
    bm.check_invariants([c, d])


def test_hit_on_free_cached_block_counts_against_free_space():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = make_seq(range(9))
    admit(bm, a)
    compute(bm, a)
    bm.free(a)  # blocks 0, 1 cached and free; block 2 plain and free
    b = make_seq(list(range(8)) + list(range(50, 62)))  # 20 tokens: 2 hit + 3 new > 4 - 2 free
    num_cached = bm.get_computed_blocks(b)
    assert num_cached == 8
    assert not bm.allocate_slots(b, 12, num_computed_from_cache=num_cached)
    assert b.block_table == [] and b.num_computed_tokens == 0 and bm.get_num_free_blocks() == 4
    assert bm.allocate_slots(b, 8, num_computed_from_cache=num_cached)  # 2 hit + 2 new fit
    assert b.block_table == [0, 1, 2, 3] and bm.get_num_free_blocks() == 0


def test_twin_computation_keeps_first_block_cached():
    bm = BlockManager(num_blocks=6, block_size=BS)
    a, b = make_seq(range(5)), make_seq(range(5))
    admit(bm, a)
    admit(bm, b)  # admitted before a computed anything: no hit
    assert a.block_table == [0, 1] and b.block_table == [2, 3]
    compute(bm, a)
    compute(bm, b)
    assert bm.cached_block_ids == {a.block_hashes[0]: 0} and bm.block_hashes[2] is None
    bm.free(b)
    assert list(bm.free_block_ids)[:2] == [2, 3]  # b's plain blocks are reused first, in order
    bm.free(a)
    bm.check_no_leak()


def test_share_prefix_ref_counts():
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    src, dst = make_seq(range(10)), make_seq(range(10))
    admit(bm, src)
    compute(bm, src)
    assert bm.share_prefix(src, dst) == 8
    assert dst.block_table == [0, 1] and dst.num_computed_tokens == 8
    assert bm.ref_counts[:3] == [2, 2, 1]
    assert bm.allocate_slots(dst, 2) and dst.block_table == [0, 1, 3]  # own copy of the partial tail
    bm.check_invariants([src, dst])
    bm.free(src)
    assert bm.ref_counts[:4] == [1, 1, 0, 1]
    bm.free(dst)
    bm.check_no_leak()


def test_share_prefix_block_aligned_prompt_leaves_last_block():
    bm = BlockManager(num_blocks=8, block_size=BS)
    src, dst = make_seq(range(8)), make_seq(range(8))
    admit(bm, src)
    compute(bm, src)
    assert bm.share_prefix(src, dst) == 4 and dst.block_table == [0]


def test_readmission_after_free_hits_own_blocks():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_seq(range(10))
    admit(bm, a)
    compute(bm, a)
    bm.free(a)  # as on preemption
    a.num_computed_tokens = 0
    assert admit(bm, a) == 8 and a.block_table == [0, 1, 2]


def test_hash_is_chained_and_deterministic():
    h0 = hash_block_tokens(None, [1, 2, 3, 4])
    assert h0 == hash_block_tokens(None, [1, 2, 3, 4])
    assert hash_block_tokens(h0, [5, 6, 7, 8]) != hash_block_tokens(None, [5, 6, 7, 8])
    assert hash_block_tokens(None, [1, 2, 3, 4]) != hash_block_tokens(None, [1, 2, 3, 5])


def test_no_leak_reports_held_blocks():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = make_seq(range(5))
    admit(bm, a)
    with pytest.raises(AssertionError, match=r"leaked.*\{0: 1, 1: 1\}"):
        bm.check_no_leak()
    bm.free(a)
    bm.check_no_leak()


@pytest.mark.parametrize("num_blocks, block_size", [(0, 16), (4, 0), (4, 2.5)])
def test_bad_sizes_rejected(num_blocks, block_size):
    with pytest.raises(ValueError, match="invalid"):
        BlockManager(num_blocks, block_size)



def test_a_share_whose_allocation_fails_and_is_retried_counts_once():
    """The scheduler frees a sibling whose tail block did not fit and retries next step: the hit
    rate once counted the shared tokens (and the query) on every try."""
    bm = BlockManager(num_blocks=3, block_size=BS)
    src, dst = make_seq(range(10)), make_seq(range(10))
    admit(bm, src)  # blocks 0, 1, 2: the cache is full
    compute(bm, src)
    assert (bm.num_queried_tokens, bm.num_hit_tokens) == (10, 0)
    for _ in range(3):  # share, no block for the tail, give back: as Scheduler._admit does
        assert bm.share_prefix(src, dst) == 8
        assert not bm.allocate_slots(dst, 2)
        bm.free(dst)
        dst.num_computed_tokens = 0
    assert (bm.num_queried_tokens, bm.num_hit_tokens) == (10, 0)
    bm.check_invariants([src])

    bm = BlockManager(num_blocks=4, block_size=BS)  # room for the tail: counted once, on success
    src, dst = make_seq(range(10)), make_seq(range(10))
    admit(bm, src)
    compute(bm, src)
    assert bm.share_prefix(src, dst) == 8 and bm.allocate_slots(dst, 2)
    assert bm.allocate_slots(dst, 1)  # later growth of the same sequence counts nothing more
    assert (bm.num_queried_tokens, bm.num_hit_tokens) == (20, 8)


# -- sliding-window pools and KV cache groups (engine.core.kv_cache_groups) -------------------
from engine.core.block_manager import NULL_BLOCK_ID  # noqa: E402
from engine.core.kv_cache_groups import HybridBlockManager, KVCacheGroup, make_block_manager  # noqa: E402


def decode(bm, seq: Sequence, token: int = 1) -> None:
    """One decode step: allocate for the next position, then pretend it ran and sampled `token`."""
    assert bm.allocate_slots(seq, 1)
    seq.num_computed_tokens += 1
    seq.append_token(token)
    bm.cache_full_blocks(seq)


def test_sliding_pool_frees_blocks_behind_the_window():
    # W = 8, bs = 4: a decode at position p sees p - 7 .. p.
    bm = BlockManager(num_blocks=6, block_size=BS, sliding_window=8)
    assert list(bm.free_block_ids) == [1, 2, 3, 4, 5, 6]  # block 0 is the null block, never handed out
    a = make_seq(range(14))
    admit(bm, a)
    assert a.block_table == [1, 2, 3, 4]
    compute(bm, a)
    decode(bm, a)  # position 14 sees 7..14: block 0 (positions 0-3) goes back
    assert a.block_table == [NULL_BLOCK_ID, 2, 3, 4] and bm.ref_counts[1] == 0
    for _ in range(6):
        decode(bm, a)  # up to position 20, which sees 13..20
    assert a.block_table == [NULL_BLOCK_ID, NULL_BLOCK_ID, NULL_BLOCK_ID, 4, 5, 6]
    bm.check_invariants([a])
    # Freed blocks kept their hashes (LRU, at the back); a block freed unregistered would go first.
    assert list(bm.free_block_ids) == [1, 2, 3]
    bm.free(a)
    bm.check_no_leak()


def test_sliding_pool_holds_a_window_however_long_the_sequence():
    W = 16
    bm = BlockManager(num_blocks=8, block_size=BS, sliding_window=W)
    a = make_seq(range(20))
    admit(bm, a)
    compute(bm, a)
    for i in range(200):
        decode(bm, a, token=i)
        held = [b for b in a.block_table if b != NULL_BLOCK_ID]
        assert len(held) <= W // BS + 2, (i, a.block_table)
    bm.free(a)
    bm.check_no_leak()


def test_sliding_cache_hit_needs_only_the_last_window():
    bm = BlockManager(num_blocks=12, block_size=BS, sliding_window=8)
    a = make_seq(range(24))
    admit(bm, a)
    compute(bm, a)  # 6 blocks, all registered
    bm.free(a)
    first_block = bm.cached_block_ids[a.block_hashes[0]]
    # Evict the first block only: a later sequence's window never reaches it.
    bm.free_block_ids.move_to_end(first_block, last=False)
    filler = make_seq(range(500, 504))
    admit(bm, filler)
    assert filler.block_table == [first_block]
    b = make_seq(list(range(24)) + [99])
    # P = 24 sees 17..23: blocks 4 and 5 are cached, so the hit is all 24 tokens.
    assert admit(bm, b) == 24
    assert b.block_table[:4] == [NULL_BLOCK_ID] * 4
    assert b.block_table[4:6] == [bm.cached_block_ids[h] for h in b.block_hashes[4:6]]
    # A full-attention pool needs block 0: no hit at all.
    full = BlockManager(num_blocks=12, block_size=BS)
    assert full.get_computed_blocks(make_seq(range(25))) == 0
    bm.free(b)
    bm.free(filler)
    bm.check_no_leak()


def test_sliding_cache_hit_stops_where_the_window_has_a_hole():
    bm = BlockManager(num_blocks=12, block_size=BS, sliding_window=8)
    a = make_seq(range(24))
    admit(bm, a)
    compute(bm, a)
    bm.free(a)
    hole = bm.cached_block_ids[a.block_hashes[4]]  # positions 16..19
    bm.free_block_ids.move_to_end(hole, last=False)
    filler = make_seq(range(500, 504))
    admit(bm, filler)
    # P = 24 needs blocks 4, 5 (hole); P = 20 needs blocks 3, 4 (hole); P = 16 needs 2, 3: hit.
    assert bm.get_computed_blocks(make_seq(list(range(24)) + [7])) == 16


def hybrid(num_blocks=16, window=8, **kw) -> HybridBlockManager:
    groups = [KVCacheGroup((0, 2), None), KVCacheGroup((1, 3), window)]
    return make_block_manager(groups, num_blocks, BS, True, max_num_seqs=2, max_num_batched_tokens=8, **kw)


def test_hybrid_pools_sizes_and_one_table_each():
    bm = hybrid()
    full, sliding = bm.pools
    # The sliding pool holds at most 2 * (cdiv(W - 1, 4) + 2) + cdiv(8, 4) = 10 blocks: each of the 2
    # sequences' windows and one step's chunk of 8 rows.
    assert (full.num_blocks, sliding.num_blocks, sliding.num_block_ids) == (16, 10, 11)
    a = make_seq(range(30))
    admit(bm, a)
    compute(bm, a)
    decode(bm, a)
    assert a.block_table == list(range(8))
    assert a.block_tables[1] == [NULL_BLOCK_ID] * 5 + [6, 7, 8]  # position 30 sees 23..30
    bm.check_invariants([a])
    bm.free(a)
    bm.check_no_leak()


def test_hybrid_allocation_is_all_or_nothing():
    bm = hybrid(num_blocks=16)  # the sliding pool gets 10
    full, sliding = bm.pools
    a, b = make_seq(range(30)), make_seq(range(100, 112))
    assert bm.allocate_slots(a, 30)  # 8 blocks in each pool (nothing is behind a window yet)
    assert not bm.allocate_slots(b, 12)  # 3 more: the full pool has 8 free, the sliding one 2
    assert b.block_tables == [[], []] and full.get_num_free_blocks() == 8 and sliding.get_num_free_blocks() == 2
    # Preemption frees both.
    bm.free(a)
    bm.check_no_leak()


def test_hybrid_cache_hit_is_the_longest_both_pools_allow():
    bm = hybrid(num_blocks=16)
    full, sliding = bm.pools
    a = make_seq(range(24))
    admit(bm, a)
    compute(bm, a)
    bm.free(a)
    # The sliding pool loses block 4 (positions 16..19): P = 24 and 20 lack a window; P = 16 does not.
    hole = sliding.cached_block_ids[a.block_hashes[4]]
    sliding.free_block_ids.move_to_end(hole, last=False)
    filler = make_seq(range(500, 504))
    assert sliding.allocate_slots(filler, 4) and filler.block_tables[1] == [hole]
    b = make_seq(list(range(24)) + [7])
    assert full.get_computed_blocks(b) == 24
    assert admit(bm, b) == 16
    assert b.block_table[:4] == [full.cached_block_ids[h] for h in b.block_hashes[:4]]
    # P = 16 sees 9..15: blocks 2 and 3; blocks 0 and 1 are placeholders.
    assert b.block_tables[1][:4] == [NULL_BLOCK_ID] * 2 + [sliding.cached_block_ids[h] for h in b.block_hashes[2:4]]
    sliding.free(filler)
    bm.free(b)
    bm.check_no_leak()
    assert bm.prefix_cache_hit_rate == full.prefix_cache_hit_rate


def test_check_fits_names_the_group():
    from engine.core.scheduler import Scheduler
    from engine.errors import PromptTooLongError

    bm = hybrid(num_blocks=4)
    sched = Scheduler(max_num_seqs=2, max_num_batched_tokens=8, max_model_len=64, block_manager=bm)
    sched.check_fits(12, 4)  # 15 KV tokens: 4 blocks in the full pool, at most 4 in the sliding one
    with pytest.raises(PromptTooLongError, match="KV cache group 0 has num_blocks=4"):
        sched.check_fits(20, 4)


def test_prefix_cache_keys_blocks_by_lora_adapter():
    """Same tokens under another adapter (or the base model) never hit: their K/V differ."""
    from engine.lora import LoRARequest

    bm = BlockManager(num_blocks=12, block_size=BS)
    lora = {i: LoRARequest(f"l{i}", i, "/unused") for i in (1, 2)}
    tokens = list(range(9))
    base = make_seq(tokens)
    admit(bm, base)
    compute(bm, base)
    a = Sequence("a", tokens, SamplingParams(max_tokens=8), lora_request=lora[1])
    assert admit(bm, a) == 0 and a.block_table == [3, 4, 5]
    compute(bm, a)
    b = Sequence("b", tokens, SamplingParams(max_tokens=8), lora_request=lora[2])
    assert admit(bm, b) == 0
    a2 = Sequence("a2", tokens, SamplingParams(max_tokens=8), lora_request=lora[1])
    assert admit(bm, a2) == 8 and a2.block_table[:2] == [3, 4]  # its own adapter's blocks
    assert base.block_hashes[0] == hash_block_tokens(None, tokens[:4])  # base-model hashes unchanged
    assert len({base.block_hashes[0], a.block_hashes[0], b.block_hashes[0]}) == 3
    for s in (base, a, b, a2):
        bm.free(s)
    bm.check_no_leak()


def test_reset_prefix_cache_forgets_every_prefix_once_no_block_is_in_use():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_seq(range(10))
    admit(bm, a)
    compute(bm, a)
    assert not bm.reset_prefix_cache() and len(bm.cached_block_ids) == 2  # a still holds its blocks
    bm.free(a)
    assert bm.reset_prefix_cache()
    assert bm.cached_block_ids == {} and list(bm.free_block_ids) == list(range(8))  # id order again
    b = make_seq(range(10))
    assert admit(bm, b) == 0 and b.block_table == [0, 1, 2]  # the same prompt computes all of it
    bm.check_invariants([b])
