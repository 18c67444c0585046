"""Fast pure-torch paged attention and cache write (the engine's CPU path).

Same contract as kernels.paged_attention. Decode sequences (one query row)
are batched into few SDPA calls, bucketed by context length so a single long
sequence does not pad the whole batch; each prefill chunk is one SDPA call.
GQA never repeats K/V: for decodes the query heads of a group are folded into
SDPA's query-length axis ([B, kv_heads, group, D]); prefill chunks use SDPA's
enable_gqa (both measured fastest on CPU for their case).

A sliding window is a mask, and the blocks wholly before a chunk's window are
not gathered at all. A soft cap or sinks, which SDPA cannot express, take
`_eager` (the scores written out) instead.

An fp8 cache (kernels/fp8_kv.py) is quantized on write and dequantized to the
query's dtype as its blocks are gathered; such a cache is always read back, even
by a fresh prefill, so this path computes what the Triton kernels compute.
"""

from typing import NamedTuple

import torch
import torch.nn.functional as F

from kernels._validate import FP8_KV_DTYPE, check_paged_attention, check_store_kv
from kernels.fp8_kv import dequantize_fp8, quantize_fp8


# SDPA's enable_gqa (torch >= 2.5) lets query heads share kv heads without a copy.
_SDPA_HAS_GQA = torch.__version__ >= "2.5"

# Reused gather buffers, CPU only: a fresh multi-MB tensor per call costs a
# page fault per 4 KiB, more than the copy itself (docs/benchmarks.md); CUDA's caching
# allocator already recycles memory. A caller pops a buffer while it uses it
# and puts it back after, so concurrent callers (dict ops are atomic under the
# GIL) never share one: the loser just allocates.
_WORKSPACE = {}


def clear_workspace() -> None:
    """Free the CPU gather buffers kept between calls."""
    _WORKSPACE.clear()


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


class ScoreOptions(NamedTuple):
    """What changes plain causal attention; all None: nothing (semantics: kernels.reference)."""

    sliding_window: int | None = None    # a query at p sees keys p - sliding_window + 1 .. p
    logits_soft_cap: float | None = None  # scaled scores -> cap * tanh(scores / cap)
    sinks: torch.Tensor | None = None     # [num_heads] logits in the denominator, no value
    k_scale: torch.Tensor | None = None   # fp8 cache: [1] fp32, K = cached value * k_scale
    v_scale: torch.Tensor | None = None   # fp8 cache: [1] fp32, V = cached value * v_scale

    @property
    def sdpa(self) -> bool:
        """Whether SDPA can run it: a window is only a mask; a soft cap or sinks are not."""
        return self.logits_soft_cap is None and self.sinks is None

    def first_key(self, pos: int) -> int:
        """The first key a query at position `pos` may see."""
        return 0 if self.sliding_window is None else max(0, pos - self.sliding_window + 1)


PLAIN = ScoreOptions()


def _visible(q_pos, k_pos, window):
    """[..., q, k] bool: key k_pos is causal for q_pos and inside its window (if any)."""
    mask = k_pos[..., None, :] <= q_pos[..., :, None]
    if window is not None:
        mask &= k_pos[..., None, :] > q_pos[..., :, None] - window
    return mask


def _eager(q, k, v, mask, scale, opts: ScoreOptions):
    """Attention with its scores written out, for what SDPA cannot do (soft cap, sinks).

    q [B, num_heads, Lq, D]; k, v [B, kv_heads, L, D]; mask bool, broadcastable to
    [B, 1, Lq, L] -> [B, num_heads, Lq, D]. Each group's query heads are folded into the
    rows, [B, kv_heads, group * Lq, D] (row g * Lq + i), so K/V are never repeated.
    """
    b, num_heads, lq, d = q.shape
    kv_heads, num_keys = k.shape[1], k.shape[2]
    group = num_heads // kv_heads
    qf = q.reshape(b, kv_heads, group * lq, d).float()
    s = torch.matmul(qf, k.float().transpose(-1, -2)) * scale  # [B, kv_heads, group * Lq, L]
    if opts.logits_soft_cap is not None:
        s = torch.tanh(s / opts.logits_soft_cap) * opts.logits_soft_cap
    rows_mask = mask.expand(b, 1, lq, num_keys)[:, :, None].expand(b, 1, group, lq, num_keys)
    s = s.masked_fill(~rows_mask.reshape(b, 1, group * lq, num_keys), float("-inf"))
    if opts.sinks is not None:  # a last column holding each row's head's sink
        sink = opts.sinks.float().view(1, kv_heads, group, 1, 1).expand(b, -1, -1, lq, 1)
        s = torch.cat([s, sink.reshape(b, kv_heads, group * lq, 1)], dim=-1)
    p = torch.softmax(s, dim=-1)[..., :num_keys]
    o = torch.matmul(p, v.float())  # [B, kv_heads, group * Lq, D]
    return o.view(b, num_heads, lq, d).to(q.dtype)


def _gather_kv(k_cache, v_cache, ids):
    """k_cache[ids], v_cache[ids] into reused buffers (on CPU).

    caches: [num_blocks, block_size, kv_heads, D]; ids: [n]
    Returns k, v: [n, block_size, kv_heads, D] and a token for _release.
    """
    ids = ids.to(torch.long)
    if k_cache.device.type != "cpu":
        return k_cache.index_select(0, ids), v_cache.index_select(0, ids), None
    shape = (ids.shape[0],) + tuple(k_cache.shape[1:])
    numel = shape[0] * k_cache[0].numel()
    # Inference tensors can't be written outside inference mode (and vice versa), so each
    # mode keeps its own buffers: a buffer from an engine step must not reach a plain call.
    key = (k_cache.dtype, k_cache.device, torch.is_inference_mode_enabled())
    bufs = _WORKSPACE.pop(key, None)
    if bufs is None or bufs[0].numel() < numel:
        bufs = tuple(torch.empty(numel, dtype=k_cache.dtype) for _ in range(2))
    k = torch.index_select(k_cache, 0, ids, out=bufs[0][:numel].view(shape))
    v = torch.index_select(v_cache, 0, ids, out=bufs[1][:numel].view(shape))
    return k, v, (key, bufs)


def _gather_dequant(k_cache, v_cache, ids, opts, dtype):
    """_gather_kv, and an fp8 cache's blocks dequantized to `dtype` (fresh tensors: the
    gather buffers go back at once)."""
    k, v, token = _gather_kv(k_cache, v_cache, ids)
    if k_cache.dtype != FP8_KV_DTYPE:
        return k, v, token
    k, v = dequantize_fp8(k, opts.k_scale, dtype), dequantize_fp8(v, opts.v_scale, dtype)
    _release(token)
    return k, v, None


def _release(token) -> None:
    if token is not None:
        key, bufs = token
        held = _WORKSPACE.get(key)
        if held is None or held[0].numel() < bufs[0].numel():
            _WORKSPACE[key] = bufs


def _index(values, device):
    """A slice when values are consecutive (a free view), else an index tensor."""
    if values == list(range(values[0], values[0] + len(values))):
        return slice(values[0], values[0] + len(values))
    return torch.tensor(values, dtype=torch.long, device=device)


def _host_lengths(seq_lens, cu_seqlens_q, seq_lens_cpu, query_lens_cpu, num_tokens, max_ctx):
    """Python copies of seq_lens and per-sequence query lengths, checked.

    Reading the device tensors costs a host sync, so callers that already
    hold host copies pass them in.
    """
    num_seqs = seq_lens.shape[0]
    seq_l = list(seq_lens_cpu) if seq_lens_cpu is not None else seq_lens.tolist()
    if query_lens_cpu is not None:
        q_l = list(query_lens_cpu)
    else:
        cu = cu_seqlens_q.tolist()
        q_l = [cu[i + 1] - cu[i] for i in range(num_seqs)]
    if len(seq_l) != num_seqs or len(q_l) != num_seqs:
        raise ValueError(
            f"seq_lens_cpu/query_lens_cpu have {len(seq_l)}/{len(q_l)} entries; "
            f"expected {num_seqs}")
    if sum(q_l) != num_tokens:
        raise ValueError(f"query lengths sum to {sum(q_l)} but query has {num_tokens} rows")
    for s, (q_len, seq_len) in enumerate(zip(q_l, seq_l)):
        if q_len < 0 or q_len > seq_len:
            raise ValueError(f"sequence {s}: query length {q_len} not in 0..seq_len={seq_len}")
        if seq_len > max_ctx:
            raise ValueError(
                f"sequence {s}: seq_len {seq_len} exceeds block_tables capacity {max_ctx}")
    return seq_l, q_l


def _decode_block_ids(block_tables, rows, first_blocks, num_blocks):
    """[B * num_blocks] block ids: each sequence's table from its first needed block on.

    first_blocks: host list (all 0 without a window: a plain slice of the table). Columns
    past a row's own blocks read whatever the table holds there; those keys are masked.
    """
    if not any(first_blocks):
        return block_tables[rows, :num_blocks].reshape(-1)
    device = block_tables.device
    cols = torch.tensor(first_blocks, device=device)[:, None] + torch.arange(num_blocks, device=device)
    cols = cols.clamp_(max=block_tables.shape[1] - 1)  # [B, num_blocks]
    return block_tables[rows].gather(1, cols).reshape(-1)


def _decode_bucket(query, k_cache, v_cache, block_tables, seq_lens, seqs, toks, first_blocks,
                   num_blocks, scale, out, opts):
    """One SDPA call for decode sequences `seqs` (one query row each, rows `toks`), over
    num_blocks blocks each from first_blocks[i] on (host list)."""
    _, block_size, kv_heads, head_dim = k_cache.shape
    batch, num_heads = len(seqs), query.shape[1]
    ctx = num_blocks * block_size
    rows = _index(seqs, query.device)
    tok_idx = _index(toks, query.device)
    ids = _decode_block_ids(block_tables, rows, first_blocks, num_blocks)  # [B * num_blocks]
    # [B * num_blocks, block_size, kv_heads, D]
    k, v, token = _gather_dequant(k_cache, v_cache, ids, opts, query.dtype)
    k = k.view(batch, ctx, kv_heads, head_dim).transpose(1, 2)  # [B, kv_heads, ctx, D] strided
    v = v.view(batch, ctx, kv_heads, head_dim).transpose(1, 2)
    # Keys past each sequence's own length are block padding (and keys before its window,
    # in its first block, are out of sight): mask them out.
    lens = seq_lens[rows].to(torch.long)  # [B]
    k_pos = torch.arange(ctx, device=query.device)[None, :]  # [1 or B, ctx]
    if any(first_blocks):
        k_pos = k_pos + torch.tensor(first_blocks, device=query.device)[:, None] * block_size
    mask = _visible((lens - 1)[:, None], k_pos, opts.sliding_window)  # [B, 1, ctx]
    if opts.sdpa:
        # [B, num_heads, D] -> [B, kv_heads, group, D]: the group is SDPA's query-length axis.
        q = query[tok_idx].reshape(batch, kv_heads, num_heads // kv_heads, head_dim)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], scale=scale)
    else:
        o = _eager(query[tok_idx][:, :, None], k, v, mask[:, None], scale, opts)
    _release(token)
    out[tok_idx] = o.reshape(batch, num_heads, head_dim).to(out.dtype)


def _decode_all(query, k_cache, v_cache, block_tables, seq_lens, seqs, starts, seq_l,
                scale, out, opts):
    """Bucket decode sequences by power-of-two block count: padding stays < 2x.

    With a window a sequence needs only the blocks from its window's first one on."""
    block_size = k_cache.shape[1]
    first = {s: opts.first_key(seq_l[s] - 1) // block_size for s in seqs}
    needed = {s: _cdiv(seq_l[s], block_size) - first[s] for s in seqs}
    buckets = {}
    for s in seqs:
        buckets.setdefault(1 << (needed[s] - 1).bit_length(), []).append(s)
    for members in buckets.values():
        toks = [starts[s] for s in members]
        _decode_bucket(query, k_cache, v_cache, block_tables, seq_lens, members, toks,
                       [first[s] for s in members], max(needed[s] for s in members), scale,
                       out, opts)


def _chunk_mask(q_len, k0, seq_len, opts, device):
    """None when SDPA's top-left causal mask is the whole story, else [q_len, seq_len - k0]
    bool for a chunk's rows (the last q_len positions) over keys k0 .. seq_len - 1."""
    if q_len == seq_len and k0 == 0 and opts.sliding_window is None and opts.sdpa:
        return None
    q_pos = torch.arange(seq_len - q_len, seq_len, device=device)
    return _visible(q_pos, torch.arange(k0, seq_len, device=device), opts.sliding_window)


def _sdpa_prefill(q, k, v, causal_mask, scale, opts=PLAIN):
    """q [1, num_heads, q_len, D], k/v [1, kv_heads, seq_len, D] -> [1, num_heads, q_len, D].

    causal_mask None: top-left aligned causal (q_len == seq_len), else a bool [q_len, seq_len].
    """
    if not opts.sdpa:
        return _eager(q, k, v, causal_mask[None, None], scale, opts)
    num_heads, kv_heads = q.shape[1], k.shape[1]
    if not _SDPA_HAS_GQA and num_heads != kv_heads:
        k = k.repeat_interleave(num_heads // kv_heads, dim=1)  # [1, num_heads, seq_len, D]
        v = v.repeat_interleave(num_heads // kv_heads, dim=1)
    gqa = {"enable_gqa": True} if _SDPA_HAS_GQA and num_heads != kv_heads else {}
    if causal_mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, **gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_mask[None, None], scale=scale,
                                          **gqa)


def prefill_fresh(query, key, value, start, q_len, scale, out, opts=PLAIN):
    """A chunk with no cached prefix (q_len == seq_len): causal SDPA on its own new K/V rows.

    query/out [num_tokens, num_heads, D], key/value [num_tokens, kv_heads, D]: rows
    start .. start + q_len. No cache read at all.
    """
    rows = slice(start, start + q_len)
    q = query[rows].transpose(0, 1)[None]  # [1, num_heads, q_len, D]
    k = key[rows].transpose(0, 1)[None]  # [1, kv_heads, q_len, D]
    v = value[rows].transpose(0, 1)[None]
    o = _sdpa_prefill(q, k, v, _chunk_mask(q_len, 0, q_len, opts, query.device), scale, opts)
    out[rows] = o[0].transpose(0, 1).to(out.dtype)  # [q_len, num_heads, D]


def prefill_cached(query, k_cache, v_cache, block_row, start, q_len, seq_len, scale, out,
                   opts=PLAIN):
    """One SDPA call for a chunk of q_len > 1 rows whose keys are 0..seq_len-1 (with a
    window: from the block of the first row's first visible key on)."""
    _, block_size, kv_heads, head_dim = k_cache.shape
    first_block = opts.first_key(seq_len - q_len) // block_size
    k0 = first_block * block_size
    ids = block_row[first_block:_cdiv(seq_len, block_size)]  # [num_blocks]
    # [num_blocks, block_size, kv_heads, D] -> [1, kv_heads, seq_len - k0, D]
    k, v, token = _gather_dequant(k_cache, v_cache, ids, opts, query.dtype)
    k = k.view(-1, kv_heads, head_dim)[:seq_len - k0].transpose(0, 1)[None]
    v = v.view(-1, kv_heads, head_dim)[:seq_len - k0].transpose(0, 1)[None]
    q = query[start:start + q_len].transpose(0, 1)[None]  # [1, num_heads, q_len, D]
    # Row i sits at absolute position seq_len - q_len + i (bottom-right aligned).
    o = _sdpa_prefill(q, k, v, _chunk_mask(q_len, k0, seq_len, opts, query.device), scale, opts)
    _release(token)
    out[start:start + q_len] = o[0].transpose(0, 1).to(out.dtype)  # [q_len, num_heads, D]


def paged_attention_torch(query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q,
                          max_seqlen_q, softmax_scale, out=None, *, seq_lens_cpu=None,
                          query_lens_cpu=None, key=None, value=None, sliding_window=None,
                          logits_soft_cap=None, sinks=None, k_scale=None, v_scale=None):
    """Pure-torch paged attention; same contract as kernels.paged_attention.

    query:        [num_tokens, num_heads, head_dim]
    k_cache:      [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: [num_seqs, max_blocks_per_seq];  seq_lens: [num_seqs]
    cu_seqlens_q: [num_seqs + 1]
    seq_lens_cpu, query_lens_cpu: optional python lists (len num_seqs) equal to
        seq_lens and diff(cu_seqlens_q); passing them avoids device->host reads.
    key, value:   optional [num_tokens, num_kv_heads, head_dim], this step's new K/V rows
        (already stored): a chunk with no cached prefix then attends over them directly.
    sliding_window, logits_soft_cap, sinks: as kernels.reference.paged_attention_ref.
    k_scale, v_scale: [1] fp32, required for (and only for) an fp8 cache; `key`/`value`
        are then ignored: the fresh chunk reads the quantized cache like every other.
    """
    check_paged_attention(query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q,
                          max_seqlen_q, softmax_scale, out, sliding_window=sliding_window,
                          logits_soft_cap=logits_soft_cap, sinks=sinks, k_scale=k_scale,
                          v_scale=v_scale)
    opts = ScoreOptions(sliding_window, logits_soft_cap, sinks, k_scale, v_scale)
    if k_cache.dtype == FP8_KV_DTYPE:
        key = value = None
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    num_tokens = query.shape[0]
    if num_tokens == 0 or block_tables.shape[0] == 0:
        return out
    max_ctx = block_tables.shape[1] * k_cache.shape[1]
    seq_l, q_l = _host_lengths(seq_lens, cu_seqlens_q, seq_lens_cpu, query_lens_cpu,
                               num_tokens, max_ctx)
    starts = [0]  # starts[s]: first query row of sequence s
    for q_len in q_l:
        starts.append(starts[-1] + q_len)
    scale = float(softmax_scale)
    decode = [s for s, q_len in enumerate(q_l) if q_len == 1]
    if decode:
        _decode_all(query, k_cache, v_cache, block_tables, seq_lens, decode, starts, seq_l,
                    scale, out, opts)
    for s, q_len in enumerate(q_l):
        if q_len > 1 and key is not None and q_len == seq_l[s]:
            prefill_fresh(query, key, value, starts[s], q_len, scale, out, opts)
        elif q_len > 1:
            prefill_cached(query, k_cache, v_cache, block_tables[s], starts[s], q_len, seq_l[s],
                           scale, out, opts)
    return out


def store_kv_torch(key, value, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    """index_copy_ scatter of key/value rows into the caches; slot < 0 skips the row.

    key, value:       [num_tokens, num_kv_heads, head_dim]
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping:     [num_tokens]
    k_scale, v_scale: [1] fp32, required for (and only for) an fp8 cache: rows stored
                      as kernels.fp8_kv.quantize_fp8(row, scale)
    """
    check_store_kv(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    num_blocks, block_size, kv_heads, head_dim = k_cache.shape
    num_slots = num_blocks * block_size
    slots = slot_mapping.to(torch.long)  # [num_tokens]
    if slots.numel() == 0:
        return
    keep = slots >= 0
    if not bool(keep.all()):  # padding rows present: drop them
        rows = keep.nonzero().squeeze(1)
        slots, key, value = slots[rows], key[rows], value[rows]
    if slots.numel() and int(slots.max()) >= num_slots:
        raise ValueError(f"slot_mapping holds slot {int(slots.max())} >= cache size {num_slots}")
    if k_cache.dtype == FP8_KV_DTYPE:
        # index_copy_ has no fp8 kernel on CPU: the same bytes, copied as uint8.
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
        key = quantize_fp8(key, k_scale).view(torch.uint8)
        value = quantize_fp8(value, v_scale).view(torch.uint8)
    k_cache.view(num_slots, kv_heads, head_dim).index_copy_(0, slots, key)
    v_cache.view(num_slots, kv_heads, head_dim).index_copy_(0, slots, value)
