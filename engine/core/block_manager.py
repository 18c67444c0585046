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


def hash_block_tokens(parent_hash: int | None, token_ids: list[int]) -> int:
    """Chained hash of one full block: sha256(parent digest || token ids as int64).

    sha256 rather than Python's `hash(tuple)`: a collision would silently hand
    one request another's KV (wrong output, or a cross-tenant leak), and
    tuple hashing is 64-bit and easy to collide on purpose. The full 256-bit
    digest is kept as an int; hashing runs once per full block, cheap next to a step.
    """
    h = hashlib.sha256(_ROOT_HASH if parent_hash is None else parent_hash.to_bytes(32, "little"))
    h.update(array("q", token_ids).tobytes())
    return int.from_bytes(h.digest(), "little")


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        check_int("num_blocks", num_blocks)
        check_int("block_size", block_size)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[int | None] = [None] * num_blocks  # hash of a registered block, else None
        self.cached_block_ids: dict[int, int] = {}                  # hash -> the block holding that prefix
        # Ordered set; front = next to hand out. Initially in id order, so tests can name exact ids.
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
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

    def get_computed_blocks(self, seq: Sequence) -> int:
        """Number of leading tokens of `seq` whose KV is in the prefix cache. Allocates nothing.

        At least one token is always left to compute, because the last
        position's logits are needed to sample. Hits are whole blocks, so a
        full-prompt hit recomputes the entire last block:

            bs = 4, 9 tokens: [a b c d][e f g h][i]  -> up to 8 tokens hit
            bs = 4, 8 tokens: [a b c d][e f g h]     -> up to 4: (8 - 1) // 4 = 1 block
        """
        assert not seq.block_table, f"{seq} already holds blocks"
        if not self.enable_prefix_caching:
            return 0
        self._update_block_hashes(seq)
        num_hits = 0
        for block_hash in seq.block_hashes[: (seq.num_tokens - 1) // self.block_size]:
            if block_hash not in self.cached_block_ids:
                break
            num_hits += 1
        return num_hits * self.block_size

    # -- allocation ----------------------------------------------------------
    def allocate_slots(self, seq: Sequence, num_new_tokens: int, num_computed_from_cache: int = 0) -> bool:
        """Give `seq` blocks for its next `num_new_tokens` tokens; False (and no change) if they don't fit.

        At admission (empty block table) pass `num_computed_from_cache` from
        `get_computed_blocks`: those cached blocks are taken first and
        `seq.num_computed_tokens` is set to it.

            |<- num_computed_tokens ->|<- from cache ->|<- num_new_tokens ->|
            [ blocks already held .... ][ cached blocks ][ new blocks ........ ]
        """
        bs = self.block_size
        admitting = not seq.block_table
        assert num_computed_from_cache % bs == 0, num_computed_from_cache
        assert admitting or num_computed_from_cache == 0, "cache hits are taken at admission only"
        assert not admitting or seq.num_computed_tokens == 0, seq
        hit_ids = [self.cached_block_ids[h] for h in seq.block_hashes[: num_computed_from_cache // bs]]
        num_tokens_after = seq.num_computed_tokens + num_computed_from_cache + num_new_tokens
        num_new_blocks = max(0, cdiv(num_tokens_after, bs) - len(seq.block_table) - len(hit_ids))
        # Hit blocks with ref 0 sit in the free queue; taking them shrinks what is left for new blocks.
        num_free_hits = sum(1 for b in hit_ids if self.ref_counts[b] == 0)
        if num_new_blocks > len(self.free_block_ids) - num_free_hits:
            return False
        for block_id in hit_ids:
            self._take(block_id)
        seq.block_table.extend(hit_ids)
        seq.block_table.extend(self._pop_free_block() for _ in range(num_new_blocks))
        if admitting:
            seq.num_computed_tokens = num_computed_from_cache
            self._num_registered_blocks[seq.seq_id] = len(hit_ids)
        shared = self._pending_shares.pop(seq.seq_id, None)
        if shared is not None:  # a sibling's share_prefix (maybe of 0 blocks), now admitted for good
            self._count_prefix_query(*shared)
        elif admitting:
            self._count_prefix_query(seq.num_tokens, num_computed_from_cache)
        return True

    def share_prefix(self, src_seq: Sequence, dst_seq: Sequence) -> int:
        """Give `dst_seq` (an n > 1 sibling) `src_seq`'s full, computed prompt blocks; returns tokens shared.

        The partial tail block is not shared: dst writes its own K/V there.
        At least one token is left for dst to compute (it needs logits).
        """
        assert not dst_seq.block_table and dst_seq.num_computed_tokens == 0, dst_seq
        assert src_seq.num_computed_tokens >= src_seq.num_prompt_tokens, "source prompt not computed yet"
        num_blocks = min(src_seq.num_prompt_tokens, dst_seq.num_tokens - 1) // self.block_size
        num_shared = num_blocks * self.block_size
        assert dst_seq.token_ids[:num_shared] == src_seq.token_ids[:num_shared], "siblings differ in prompt"
        shared_ids = src_seq.block_table[:num_blocks]
        for block_id in shared_ids:
            self._take(block_id)
        dst_seq.block_table.extend(shared_ids)
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
        for i in range(start, num_full):
            block_id, block_hash = seq.block_table[i], seq.block_hashes[i]
            if self.block_hashes[block_id] is not None:
                # Taken from the cache or shared by a sibling: already registered.
                assert self.block_hashes[block_id] == block_hash, (seq, i)
            elif block_hash not in self.cached_block_ids:
                self.block_hashes[block_id] = block_hash
                self.cached_block_ids[block_hash] = block_id
            # else: another sequence computed the same prefix first; keep its block, ours stays plain.
        self._num_registered_blocks[seq.seq_id] = num_full

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s references. Its blocks go back in reverse, so its tail is evicted before its head
        (a later request sharing only the beginning of this prefix still hits)."""
        for block_id in reversed(seq.block_table):
            self.ref_counts[block_id] -= 1
            assert self.ref_counts[block_id] >= 0, block_id
            if self.ref_counts[block_id] == 0:
                self.free_block_ids[block_id] = None
                if self.block_hashes[block_id] is None:
                    self.free_block_ids.move_to_end(block_id, last=False)
        seq.block_table.clear()
        self._num_registered_blocks.pop(seq.seq_id, None)
        self._pending_shares.pop(seq.seq_id, None)

    # -- internals -----------------------------------------------------------
    def _count_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        if self.enable_prefix_caching:
            self.num_queried_tokens += num_tokens
            self.num_hit_tokens += num_hit_tokens

    def _update_block_hashes(self, seq: Sequence) -> None:
        """Extend `seq.block_hashes` to every full block of its tokens (tokens are append-only)."""
        bs, hashes = self.block_size, seq.block_hashes
        parent = hashes[-1] if hashes else None
        for i in range(len(hashes), seq.num_tokens // bs):
            parent = hash_block_tokens(parent, seq.token_ids[i * bs:(i + 1) * bs])
            hashes.append(parent)

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
        assert self.ref_counts[block_id] == 0
        self.ref_counts[block_id] = 1
        return block_id

    # -- checks (tests and the engine's test fixtures) ----------------------------
    def check_invariants(self, live_seqs: list[Sequence]) -> None:
        """Ref counts equal block-table references; the free queue is exactly the ref-0 blocks;
        the hash index and the per-block hashes agree."""
        refs = [0] * self.num_blocks
        for seq in live_seqs:
            for block_id in seq.block_table:
                refs[block_id] += 1
        assert refs == self.ref_counts, _diff("ref_counts", self.ref_counts, refs)
        zero = {b for b in range(self.num_blocks) if refs[b] == 0}
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
