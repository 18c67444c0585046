"""Paged KV-cache bookkeeping: fixed-size blocks, ref counts, and a prefix cache. No torch.

A sequence's KV lives in `seq.block_table`; token position p sits in block
`block_table[p // block_size]` at offset `p % block_size`:

    block_size = 4, 10 tokens:   [t0 t1 t2 t3][t4 t5 t6 t7][t8 t9 __ __]
    block_table                     7            2            5

Prefix caching: once a block is full *and* computed it is registered under a
chained hash of (parent block's hash, its token ids), so the hash of block i
names the whole prefix t0..t(4i+3). A later sequence whose leading blocks hash
the same reuses them (ref_count += 1) instead of recomputing them.

Free blocks wait in `free_block_ids`, front = handed out next. A freed block
that still carries a hash goes to the back (least recently used evicted first)
and keeps its hash until it is handed out again; a block without one goes to
the front, since nothing is lost by reusing it first.

Sliding-window pools (`sliding_window=W`): a query at position p sees keys
p - W + 1 .. p only, so before each allocation the blocks wholly before the
first position the new rows can see, (num_computed_tokens - W + 1) // block_size,
go back to the pool and their table entries become NULL_BLOCK_ID, a reserved
block no kernel reads (they start at the window's first block) and that is
never handed out. Such a pool holds `num_blocks` usable ids 1..num_blocks:

    W = 8, bs = 4, 14 tokens computed, decoding position 14 (sees 7..14):
    block_table   [0 (null)][ 9 ][ 4 ][ 2 ]      positions 0-3 freed; 4-7 kept (7 is visible)
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from engine.errors import check_int
from engine.math_utils import cdiv
from engine.core.sequence import Sequence

# Parent "hash" of a sequence's first block.
_ROOT_HASH = b"\0" * 32
# The placeholder of a freed sliding-window block in a table: a valid id, never handed out.
NULL_BLOCK_ID = 0


def hash_block_tokens(parent_hash: int | None, token_ids: list[int], lora_int_id: int = 0) -> int:
    """Chained hash of one full block: sha256(parent digest || token ids as int64 [|| LoRA id]).

    A sequence running a LoRA adapter computes other K/V for the same tokens, so its blocks hash
    with the adapter's id (every block, as vLLM's extra keys): no request ever reuses another
    adapter's KV, or the base model's. Base-model hashes are unchanged (id 0 adds nothing).

    sha256 rather than Python's `hash(tuple)`: a collision would silently hand
    one request another's KV (wrong output, or a cross-tenant leak), and
    tuple hashing is 64-bit and easy to collide on purpose. The full 256-bit
    digest is kept as an int; hashing runs once per full block, cheap next to a step.
    """
    h = hashlib.sha256(_ROOT_HASH if parent_hash is None else parent_hash.to_bytes(32, "little"))
    h.update(array("q", token_ids).tobytes())
    if lora_int_id:
        h.update(b"lora" + lora_int_id.to_bytes(8, "little"))
    return int.from_bytes(h.digest(), "little")


class BlockManager:
    """One pool of KV blocks and the tables of one KV cache group (`group`: which of a
    sequence's `block_tables` it owns; 0 unless the model mixes full and sliding layers)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 sliding_window: int | None = None, group: int = 0):
        check_int("num_blocks", num_blocks)
        check_int("block_size", block_size)
        if sliding_window is not None:
            check_int("sliding_window", sliding_window)
        self.num_blocks = num_blocks  # usable blocks (a sliding pool has one more id: the null block)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window
        self.group = group
        first_id = 0 if sliding_window is None else NULL_BLOCK_ID + 1
        self.num_block_ids = num_blocks + first_id  # rows of this group's cache tensors
        self.ref_counts = [0] * self.num_block_ids
        self.block_hashes: list[int | None] = [None] * self.num_block_ids  # hash of a registered block, else None
        self.cached_block_ids: dict[int, int] = {}                  # hash -> the block holding that prefix
        # Ordered set; front = next to hand out. Initially in id order, so tests can name exact ids.
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(first_id, self.num_block_ids))
        # seq_id -> how many leading blocks of its table cache_full_blocks has already looked at.
        self._num_registered_blocks: dict[int, int] = {}
        # Prefix-cache hit rate = num_hit_tokens / num_queried_tokens (tokens, as vLLM counts them),
        # counted once per admission that succeeds: an allocation that fails is retried later.
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0
        # seq_id -> (tokens queried, tokens shared) of a share_prefix whose allocate_slots is pending.
        self._pending_shares: dict[int, tuple[int, int]] = {}

    # -- queries -------------------------------------------------------------
    def get_num_free_blocks(self) -> int:
        """Blocks with ref_count 0, cached-but-evictable ones included."""
        return len(self.free_block_ids)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free_block_ids) / self.num_blocks

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0

    def get_computed_blocks(self, seq: Sequence, max_num_tokens: int | None = None) -> int:
        """Number of leading tokens of `seq` whose KV is in the prefix cache. Allocates nothing.

        At least one token is always left to compute, because the last
        position's logits are needed to sample. Hits are whole blocks, so a
        full-prompt hit recomputes the entire last block:

            bs = 4, 9 tokens: [a b c d][e f g h][i]  -> up to 8 tokens hit
            bs = 4, 8 tokens: [a b c d][e f g h]     -> up to 4: (8 - 1) // 4 = 1 block

        A sliding pool needs only what the first computed position P sees: the longest
        block-aligned P (at most `max_num_tokens`) whose blocks covering P - W + 1 .. P - 1
        are all cached, however much before them was evicted (vLLM's sliding-window rule).
        """
        assert not self._table(seq), f"{seq} already holds blocks"
        if not self.enable_prefix_caching:
            return 0
        self._update_block_hashes(seq)
        bs = self.block_size
        limit = (seq.num_tokens - 1) // bs
        if max_num_tokens is not None:
            limit = min(limit, max_num_tokens // bs)
        cached = [self._is_cached(h) for h in seq.block_hashes[:limit]]
        if self.sliding_window is None:
            return (cached.index(False) if False in cached else limit) * bs
        for num_hit_blocks in range(limit, 0, -1):
            if all(cached[self._num_skipped_blocks(num_hit_blocks * bs):num_hit_blocks]):
                return num_hit_blocks * bs
        return 0

    # -- allocation ----------------------------------------------------------
    def allocate_slots(self, seq: Sequence, num_new_tokens: int, num_computed_from_cache: int = 0) -> bool:
        """Give `seq` blocks for its next `num_new_tokens` tokens; False (and no change but the
        freeing of blocks behind a window, which no row reads again) if they don't fit.

        At admission (empty block table) pass `num_computed_from_cache` from
        `get_computed_blocks`: those cached blocks are taken first and
        `seq.num_computed_tokens` is set to it.

            |<- num_computed_tokens ->|<- from cache ->|<- num_new_tokens ->|
            [ blocks already held .... ][ cached blocks ][ new blocks ........ ]
        """
        self.remove_skipped_blocks(seq)
        if self.num_blocks_to_allocate(seq, num_new_tokens, num_computed_from_cache) > len(self.free_block_ids):
            return False
        self.allocate_checked(seq, num_new_tokens, num_computed_from_cache)
        return True

    def remove_skipped_blocks(self, seq: Sequence) -> None:
        """Sliding pool: free the blocks before the first key the next rows of `seq` can see."""
        table = self._table(seq)
        if self.sliding_window is None or not table:
            return
        for i in range(min(self._num_skipped_blocks(seq.num_computed_tokens), len(table))):
            if not self._is_null(table[i]):
                self._release(table[i])
                table[i] = NULL_BLOCK_ID

    def num_blocks_to_allocate(self, seq: Sequence, num_new_tokens: int, num_computed_from_cache: int = 0) -> int:
        """Free blocks that `allocate_checked` would take (cached hits with ref 0 included)."""
        table = self._table(seq)
        num_tokens_after = seq.num_computed_tokens + num_computed_from_cache + num_new_tokens
        hit_ids = self._hit_block_ids(seq, num_computed_from_cache)
        num_new_blocks = max(0, cdiv(num_tokens_after, self.block_size) - len(table) - len(hit_ids))
        # Hit blocks with ref 0 sit in the free queue; taking them shrinks what is left for new blocks.
        # A hit held in another tier (None) takes a free block to be copied into.
        return num_new_blocks + sum(1 for b in hit_ids if b is None or not self._is_null(b) and self.ref_counts[b] == 0)

    def allocate_checked(self, seq: Sequence, num_new_tokens: int, num_computed_from_cache: int = 0) -> None:
        """allocate_slots once `num_blocks_to_allocate` is known to fit (a coordinator of pools checks all first)."""
        bs, table = self.block_size, self._table(seq)
        admitting = not table
        assert num_computed_from_cache % bs == 0, num_computed_from_cache
        assert admitting or num_computed_from_cache == 0, "cache hits are taken at admission only"
        assert not admitting or seq.num_computed_tokens == 0, seq
        assert self.num_blocks_to_allocate(seq, num_new_tokens, num_computed_from_cache) <= len(self.free_block_ids)
        hit_ids = self._hit_block_ids(seq, num_computed_from_cache)
        num_tokens_after = seq.num_computed_tokens + num_computed_from_cache + num_new_tokens
        num_new_blocks = max(0, cdiv(num_tokens_after, bs) - len(table) - len(hit_ids))
        table.extend(self._take_hit_blocks(seq, hit_ids))
        table.extend(self._pop_free_block() for _ in range(num_new_blocks))
        if admitting:
            seq.num_computed_tokens = num_computed_from_cache
            self._num_registered_blocks[seq.seq_id] = len(hit_ids)
        shared = self._pending_shares.pop(seq.seq_id, None)
        if shared is not None:  # a sibling's share_prefix (maybe of 0 blocks), now admitted for good
            self._count_prefix_query(*shared)
        elif admitting:
            self._count_prefix_query(seq.num_tokens, num_computed_from_cache)

    def num_shareable_tokens(self, src_seq: Sequence, dst_seq: Sequence) -> int:
        """Tokens of `src_seq`'s prompt that share_prefix would give `dst_seq`: its full computed
        prompt blocks (at least one token left to compute), or 0 from a sliding pool that has
        already freed a block `dst_seq`'s first rows would see."""
        num_shared = min(src_seq.num_prompt_tokens, dst_seq.num_tokens - 1) // self.block_size * self.block_size
        src_table = self._table(src_seq)
        needed = src_table[self._num_skipped_blocks(num_shared):num_shared // self.block_size]
        return 0 if any(self._is_null(b) for b in needed) else num_shared

    def share_prefix(self, src_seq: Sequence, dst_seq: Sequence, num_tokens: int | None = None) -> int:
        """Give `dst_seq` (an n > 1 sibling) `src_seq`'s full, computed prompt blocks; returns tokens shared.

        The partial tail block is not shared: dst writes its own K/V there.
        At least one token is left for dst to compute (it needs logits).
        `num_tokens` (at most num_shareable_tokens, a block multiple) shares fewer.
        """
        assert not self._table(dst_seq) and dst_seq.num_computed_tokens == 0, dst_seq
        assert src_seq.num_computed_tokens >= src_seq.num_prompt_tokens, "source prompt not computed yet"
        num_shared = self.num_shareable_tokens(src_seq, dst_seq) if num_tokens is None else num_tokens
        assert num_shared % self.block_size == 0 and num_shared <= self.num_shareable_tokens(src_seq, dst_seq)
        num_blocks = num_shared // self.block_size
        assert dst_seq.token_ids[:num_shared] == src_seq.token_ids[:num_shared], "siblings differ in prompt"
        shared_ids = self._table(src_seq)[:num_blocks]
        for i, block_id in enumerate(shared_ids):
            if i < self._num_skipped_blocks(num_shared):
                shared_ids[i] = NULL_BLOCK_ID  # before dst's window: not taken
            elif not self._is_null(block_id):
                self._take(block_id)
        self._table(dst_seq).extend(shared_ids)
        dst_seq.num_computed_tokens = num_shared
        self._num_registered_blocks[dst_seq.seq_id] = num_blocks
        # Counted by the allocate_slots that follows, if it succeeds (else free() forgets it).
        self._pending_shares[dst_seq.seq_id] = (dst_seq.num_tokens, num_shared)
        return num_shared

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks of `seq` that are now full and computed (call after each step)."""
        if not self.enable_prefix_caching:
            return
        start = self._num_registered_blocks.get(seq.seq_id, 0)
        # Only blocks whose token ids are known: with overlapped scheduling the computed count may
        # run one placeholder ahead of them. (Their K/V may still be in flight on the device;
        # any reader is a later step on the same stream.)
        num_full = min(seq.num_computed_tokens, seq.num_tokens) // self.block_size
        if num_full <= start:
            return
        self._update_block_hashes(seq)
        table = self._table(seq)
        for i in range(start, num_full):
            block_id, block_hash = table[i], seq.block_hashes[i]
            if self._is_null(block_id):
                continue  # freed behind the window before it was registered: its KV is not kept
            if self.block_hashes[block_id] is not None:
                # Taken from the cache or shared by a sibling: already registered.
                assert self.block_hashes[block_id] == block_hash, (seq, i)
            elif block_hash not in self.cached_block_ids:
                self.block_hashes[block_id] = block_hash
                self.cached_block_ids[block_hash] = block_id
            # else: another sequence computed the same prefix first; keep its block, ours stays plain.
        self._num_registered_blocks[seq.seq_id] = num_full

    def free_blocks_past(self, seq: Sequence, num_tokens: int) -> None:
        """Release `seq`'s blocks wholly past its first `num_tokens` tokens: the slots of draft
        tokens that verification rejected (speculative decoding). The next step allocates again.

            bs = 4, 6 tokens kept:  [t0 t1 t2 t3][t4 t5 d d][d d _ _]  ->  the third block goes

        None of them was registered in the prefix cache: only blocks full of computed, accepted
        tokens are (cache_full_blocks), and those all lie before `num_tokens`.
        """
        table = self._table(seq)
        keep = cdiv(num_tokens, self.block_size)
        for block_id in reversed(table[keep:]):
            assert self.block_hashes[block_id] is None, (seq, block_id)
            self._release(block_id)
        del table[keep:]

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s references. Its blocks go back in reverse, so its tail is evicted before its head
        (a later request sharing only the beginning of this prefix still hits)."""
        table = self._table(seq)
        for block_id in reversed(table):
            if not self._is_null(block_id):
                self._release(block_id)
        table.clear()
        self._num_registered_blocks.pop(seq.seq_id, None)
        self._pending_shares.pop(seq.seq_id, None)

    def take_swaps(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The copies to and from a second KV tier that this step's allocations planned (none here:
        engine/core/kv_offload.py)."""
        return [], []

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's `reset_prefix_cache`): the free blocks lose their hashes
        and go back to id order. False, and nothing changes, while any block is in use."""
        if any(self.ref_counts):
            return False
        first_id = self.num_block_ids - self.num_blocks
        self.cached_block_ids.clear()
        self.block_hashes = [None] * self.num_block_ids
        self.free_block_ids = OrderedDict.fromkeys(range(first_id, self.num_block_ids))
        self._num_registered_blocks.clear()
        return True

    # -- internals -----------------------------------------------------------
    def _is_cached(self, block_hash: int) -> bool:
        """Whether a prefix-cache hit on `block_hash` can be taken (in this pool; a tier adds its own)."""
        return block_hash in self.cached_block_ids

    def _take_hit_blocks(self, seq: Sequence, hit_ids: list[int]) -> list[int]:
        """Take a reference to each hit block (not to NULL_BLOCK_ID); the table entries they become."""
        for block_id in hit_ids:
            if not self._is_null(block_id):
                self._take(block_id)
        return hit_ids

    def _on_evict(self, block_id: int, block_hash: int) -> None:
        """A cached block is handed out again and its KV is about to be overwritten (a tier keeps a copy)."""

    def _count_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        if self.enable_prefix_caching:
            self.num_queried_tokens += num_tokens
            self.num_hit_tokens += num_hit_tokens

    def _update_block_hashes(self, seq: Sequence) -> None:
        """Extend `seq.block_hashes` to every full block of its tokens (tokens are append-only)."""
        bs, hashes = self.block_size, seq.block_hashes
        parent = hashes[-1] if hashes else None
        for i in range(len(hashes), seq.num_tokens // bs):
            parent = hash_block_tokens(parent, seq.token_ids[i * bs:(i + 1) * bs], seq.lora_int_id)
            hashes.append(parent)

    def _table(self, seq: Sequence) -> list[int]:
        """`seq`'s block table in this pool's group."""
        tables = seq.block_tables
        while len(tables) <= self.group:
            tables.append([])
        return tables[self.group]

    def _is_null(self, block_id: int) -> bool:
        """A placeholder for a block freed behind the window (sliding pools only)."""
        return block_id == NULL_BLOCK_ID and self.sliding_window is not None

    def _num_skipped_blocks(self, num_computed_tokens: int) -> int:
        """Leading blocks no row from position `num_computed_tokens` on can see (0 without a window)."""
        if self.sliding_window is None:
            return 0
        return max(0, num_computed_tokens - self.sliding_window + 1) // self.block_size

    def _hit_block_ids(self, seq: Sequence, num_computed_from_cache: int) -> list[int]:
        """The table entries a cache hit of `num_computed_from_cache` tokens starts with:
        NULL_BLOCK_ID where a sliding pool needs nothing (before the window)."""
        num_hit_blocks = num_computed_from_cache // self.block_size
        skipped = min(self._num_skipped_blocks(num_computed_from_cache), num_hit_blocks)
        return [NULL_BLOCK_ID] * skipped + [self.cached_block_ids[h] for h in seq.block_hashes[skipped:num_hit_blocks]]

    def _release(self, block_id: int) -> None:
        """One reference less; at 0 the block is free (kept for the prefix cache if it has a hash)."""
        self.ref_counts[block_id] -= 1
        assert self.ref_counts[block_id] >= 0, block_id
        if self.ref_counts[block_id] == 0:
            self.free_block_ids[block_id] = None
            if self.block_hashes[block_id] is None:
                self.free_block_ids.move_to_end(block_id, last=False)

    def _take(self, block_id: int) -> None:
        """One more reference to a block that holds wanted KV (a cache hit or a shared prefix)."""
        if self.ref_counts[block_id] == 0:
            del self.free_block_ids[block_id]
        self.ref_counts[block_id] += 1

    def _pop_free_block(self) -> int:
        block_id, _ = self.free_block_ids.popitem(last=False)
        block_hash = self.block_hashes[block_id]
        if block_hash is not None:  # evict: its KV is about to be overwritten
            assert self.cached_block_ids[block_hash] == block_id
            del self.cached_block_ids[block_hash]
            self.block_hashes[block_id] = None
            self._on_evict(block_id, block_hash)
        assert self.ref_counts[block_id] == 0
        self.ref_counts[block_id] = 1
        return block_id

    # -- checks (tests and the engine's test fixtures) ----------------------------
    def check_invariants(self, live_seqs: list[Sequence]) -> None:
        """Ref counts equal block-table references; the free queue is exactly the ref-0 blocks;
        the hash index and the per-block hashes agree."""
        refs = [0] * self.num_block_ids
        for seq in live_seqs:
            for block_id in self._table(seq):
                refs[block_id] += 1
        if self.sliding_window is not None:
            refs[NULL_BLOCK_ID] = 0  # a placeholder, not a reference
        assert refs == self.ref_counts, _diff("ref_counts", self.ref_counts, refs)
        zero = {b for b in range(self.num_block_ids - self.num_blocks, self.num_block_ids) if refs[b] == 0}
        assert set(self.free_block_ids) == zero, f"free queue {sorted(self.free_block_ids)} != ref-0 blocks {sorted(zero)}"
        for block_hash, block_id in self.cached_block_ids.items():
            assert self.block_hashes[block_id] == block_hash, f"block {block_id} hash mismatch"
        assert sum(h is not None for h in self.block_hashes) == len(self.cached_block_ids)

    def check_no_leak(self) -> None:
        """Raise AssertionError naming the blocks still referenced (call when no request is live)."""
        held = {b: r for b, r in enumerate(self.ref_counts) if r}
        assert not held, f"KV blocks leaked: {{block_id: ref_count}} = {held}"
        assert len(self.free_block_ids) == self.num_blocks, (
            f"free queue has {len(self.free_block_ids)} of {self.num_blocks} blocks")
        self.check_invariants([])


def _diff(name: str, actual: list[int], expected: list[int]) -> str:
    bad = {i: (a, e) for i, (a, e) in enumerate(zip(actual, expected)) if a != e}
    return f"{name} wrong at {{block_id: (actual, expected)}} = {bad}"
