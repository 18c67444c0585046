"""Triton kernel: causal varlen attention of new query rows over a paged KV cache.

One launch serves a whole mixed batch (prefill chunks and single-token
decodes). Program (q_tile, kv_head) owns BLOCK_Q consecutive query rows of ONE
sequence times all GROUP query heads that share kv_head, i.e. BLOCK_M =
BLOCK_Q * GROUP_P rows of the score matrix; each K/V tile is therefore loaded
once for the whole GQA group. Softmax is online (running max / sum in fp32),
so no [q_len, seq_len] matrix ever exists.

Query tiles are numbered without a host sync: sequence s owns tile indices
starting at cu_seqlens_q[s] // BLOCK_Q + s, so num_tokens // BLOCK_Q + num_seqs
programs always suffice; surplus programs exit at once.

Split-KV (SPLIT=True, grid axis 2 = segment): the same program attends over
only segment `split` of its keys (`_segment`: tile-aligned, equal runs, sized
on the device from seq_lens) and writes its normalised output, running max and
sum as fp32 partials instead of the output; kernels/triton_attention_split.py
merges them. Rows keep their causal horizon in every segment, so split launches
are exact for prefill chunks too; a segment a row cannot see leaves it l = 0.

Score changes (semantics: kernels/reference.py), each a constexpr flag, so a
plain launch compiles without them: SLIDING masks keys before each row's window
and starts the key walk at the tile holding the program's first row's first
key (tiles wholly before every window are never loaded; split segments divide
only what is left); SOFT_CAP caps the scores (tanh from exp2, which the
interpreter and every GPU have); HAS_SINKS folds a per-head logit with no value
into the softmax state after the walk (in segment 0 only when split, so the
reduce counts it once).

An fp8 cache (FP8_KV): K/V tiles are e4m3 (kernels/fp8_kv.py), converted to the query's
dtype exactly (every e4m3 value is an fp16 / bf16 value) for the dots. The per-tensor scales
never touch a tile: k_scale joins the score scale (q . (k8 * ks) = (q . k8) * ks) and v_scale
multiplies the accumulator once after the walk (sum p (v8 * vs) = vs * sum p v8), so the inner
loop is the same as for a half-precision cache.
"""

import triton
import triton.language as tl

# Finite "minus infinity" for the running max: a fully masked row then yields
# exp2(-inf - NEG_BIG) = 0 instead of exp2(-inf + inf) = NaN.
NEG_BIG = tl.constexpr(-1.0e30)
LOG2_E = tl.constexpr(1.4426950408889634)


@triton.jit
def _find_seq(cu_seqlens_q_ptr, q_tile, num_seqs, BLOCK_Q: tl.constexpr):
    """Largest s with cu_seqlens_q[s] // BLOCK_Q + s <= q_tile (binary search)."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(cu_seqlens_q_ptr + mid, mask=mid < num_seqs, other=0)
        if start // BLOCK_Q + mid <= q_tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _load_kv_one_block(k_cache_ptr, v_cache_ptr, bt_row_ptr, max_blocks, kv_head_off,
                       stride_c_blk, stride_c_pos, tile_start, kv_end, offs_d, d_valid,
                       BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr):
    """K/V tile when TILE_N divides BLOCK_SIZE, so the tile sits inside one cache block.

    One scalar block id gives a 64-bit base; the per-element offsets are small
    int32 and loop-invariant, which keeps register pressure far below a
    per-key gather. Returns k [HEAD_DIM_P, TILE_N], v [TILE_N, HEAD_DIM_P],
    key_pos [TILE_N], key_valid [TILE_N].
    """
    offs_n = tl.arange(0, TILE_N)  # [TILE_N]
    key_pos = tile_start + offs_n
    key_valid = key_pos < kv_end
    blk_idx = tile_start // BLOCK_SIZE
    blk = tl.load(bt_row_ptr + blk_idx, mask=blk_idx < max_blocks, other=0).to(tl.int64)
    # int64: block_id * stride_blk overflows int32 once the cache passes 2G elements.
    base = blk * stride_c_blk + (tile_start % BLOCK_SIZE) * stride_c_pos + kv_head_off
    k = tl.load(k_cache_ptr + base + (offs_n[None, :] * stride_c_pos + offs_d[:, None]),
                mask=d_valid[:, None] & key_valid[None, :], other=0.0)
    v = tl.load(v_cache_ptr + base + (offs_n[:, None] * stride_c_pos + offs_d[None, :]),
                mask=key_valid[:, None] & d_valid[None, :], other=0.0)
    return k, v, key_pos, key_valid


@triton.jit
def _load_kv_gather(k_cache_ptr, v_cache_ptr, bt_row_ptr, max_blocks, kv_head_off,
                    stride_c_blk, stride_c_pos, tile_start, kv_end, offs_d, d_valid,
                    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr):
    """K/V tile spanning several cache blocks (block sizes that TILE_N does not divide).

    Same returns as _load_kv_one_block; each key looks up its own block id.
    """
    key_pos = tile_start + tl.arange(0, TILE_N)  # [TILE_N]
    blk_idx = key_pos // BLOCK_SIZE
    key_valid = (key_pos < kv_end) & (blk_idx < max_blocks)
    blk = tl.load(bt_row_ptr + blk_idx, mask=key_valid, other=0).to(tl.int64)  # [TILE_N]
    kv_off = blk * stride_c_blk + (key_pos % BLOCK_SIZE) * stride_c_pos + kv_head_off  # [TILE_N]
    k = tl.load(k_cache_ptr + kv_off[None, :] + offs_d[:, None],
                mask=d_valid[:, None] & key_valid[None, :], other=0.0)
    v = tl.load(v_cache_ptr + kv_off[:, None] + offs_d[None, :],
                mask=key_valid[:, None] & d_valid[None, :], other=0.0)
    return k, v, key_pos, key_valid


@triton.jit
def _tanh(x):
    """tanh from exp2: sign(x) (1 - e^-2|x|) / (1 + e^-2|x|), which never overflows."""
    t = tl.exp2(tl.abs(x) * (-2.0 * LOG2_E))
    r = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0, -r, r)


@triton.jit
def _softmax_step(q, k, v, m_i, l_i, acc, key_pos, key_valid, q_horizon, scale_log2,
                  window, soft_cap_log2, IEEE_DOT: tl.constexpr, SLIDING: tl.constexpr,
                  SOFT_CAP: tl.constexpr):
    """Fold one K/V tile into the running softmax state.

    q: [BLOCK_M, HEAD_DIM_P]; k: [HEAD_DIM_P, TILE_N]; v: [TILE_N, HEAD_DIM_P]
    m_i, l_i: [BLOCK_M] fp32; acc: [BLOCK_M, HEAD_DIM_P] fp32
    q_horizon: [BLOCK_M] last key position each row may see (causal bound)
    window (SLIDING): a row sees keys q_horizon - window + 1 .. q_horizon
    soft_cap_log2 (SOFT_CAP): the cap times log2(e), as the scores are in the log2 domain
    """
    k = k.to(q.dtype)
    v = v.to(q.dtype)
    if IEEE_DOT:
        s = tl.dot(q, k, input_precision="ieee")  # [BLOCK_M, TILE_N]
    else:
        s = tl.dot(q, k)
    s = s * scale_log2
    if SOFT_CAP:  # cap * tanh(score / cap), scaled by log2(e) on both sides
        s = soft_cap_log2 * _tanh(s / soft_cap_log2)
    visible = (key_pos[None, :] <= q_horizon[:, None]) & key_valid[None, :]  # [BLOCK_M, TILE_N]
    if SLIDING:
        visible = visible & (key_pos[None, :] > q_horizon[:, None] - window)
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))  # [BLOCK_M]
    p = tl.exp2(s - m_new[:, None])  # [BLOCK_M, TILE_N]
    alpha = tl.exp2(m_i - m_new)  # rescales what was accumulated under the old max
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if IEEE_DOT:
        pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    acc = acc * alpha[:, None] + pv  # [BLOCK_M, HEAD_DIM_P]
    return m_new, l_i, acc


@triton.jit
def _locate_tile(cu_seqlens_q_ptr, seq_lens_ptr, q_tile, num_seqs, BLOCK_Q: tl.constexpr):
    """Map a program's query-tile index to (seq, q_start, q_len, tile_in_seq, seq_len)."""
    seq = _find_seq(cu_seqlens_q_ptr, q_tile, num_seqs, BLOCK_Q)
    ok = seq < num_seqs
    q_start = tl.load(cu_seqlens_q_ptr + seq, mask=ok, other=0)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1, mask=ok, other=0) - q_start
    seq_len = tl.load(seq_lens_ptr + seq, mask=ok, other=0)
    tile_in_seq = q_tile - (q_start // BLOCK_Q + seq)
    return seq, q_start, q_len, tile_in_seq, seq_len


@triton.jit
def _attend(q, k_cache_ptr, v_cache_ptr, bt_row_ptr, max_blocks, kv_head_off, stride_c_blk,
            stride_c_pos, kv_start, kv_end, q_horizon, scale_log2, window, soft_cap_log2,
            offs_d, d_valid, BLOCK_M: tl.constexpr, HEAD_DIM_P: tl.constexpr,
            BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, ONE_BLOCK_TILES: tl.constexpr,
            IEEE_DOT: tl.constexpr, SLIDING: tl.constexpr, SOFT_CAP: tl.constexpr):
    """Online-softmax attention of q over keys [kv_start, kv_end) (kv_start a multiple of TILE_N).

    q: [BLOCK_M, HEAD_DIM_P] -> acc [BLOCK_M, HEAD_DIM_P] fp32 (unnormalised),
    m_i [BLOCK_M] running max (log2 domain), l_i [BLOCK_M] running sum. A row that
    sees no key in the range keeps m_i = NEG_BIG, l_i = 0, acc = 0.
    """
    m_i = tl.full([BLOCK_M], NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], dtype=tl.float32)
    for tile_start in range(kv_start, kv_end, TILE_N):
        if ONE_BLOCK_TILES:
            k, v, key_pos, key_valid = _load_kv_one_block(
                k_cache_ptr, v_cache_ptr, bt_row_ptr, max_blocks, kv_head_off, stride_c_blk,
                stride_c_pos, tile_start, kv_end, offs_d, d_valid, BLOCK_SIZE, TILE_N)
        else:
            k, v, key_pos, key_valid = _load_kv_gather(
                k_cache_ptr, v_cache_ptr, bt_row_ptr, max_blocks, kv_head_off, stride_c_blk,
                stride_c_pos, tile_start, kv_end, offs_d, d_valid, BLOCK_SIZE, TILE_N)
        m_i, l_i, acc = _softmax_step(q, k, v, m_i, l_i, acc, key_pos, key_valid, q_horizon,
                                      scale_log2, window, soft_cap_log2, IEEE_DOT, SLIDING,
                                      SOFT_CAP)
    return acc, m_i, l_i


@triton.jit
def _fold_sink(acc, m_i, l_i, sinks_ptr, head, row_valid, included):
    """The head's sink joins the softmax state: one more logit, exp2(sink - max), no value.

    head, row_valid: [BLOCK_M]; included: whether this program counts it (segment 0 of a
    split launch, every program otherwise). Returns acc, m_i, l_i.
    """
    sink = tl.load(sinks_ptr + head, mask=row_valid, other=0.0).to(tl.float32) * LOG2_E
    m_new = tl.where(included, tl.maximum(m_i, sink), m_i)
    alpha = tl.exp2(m_i - m_new)
    # Not included, sink - m_new may be huge: clamped, so the unused exp2 cannot overflow.
    l_i = l_i * alpha + tl.where(included, tl.exp2(tl.minimum(sink - m_new, 0.0)), 0.0)
    return acc * alpha[:, None], m_new, l_i


@triton.jit
def _segment(kv_start, kv_end, split, num_splits, TILE_N: tl.constexpr):
    """Key range [seg_start, seg_end) of segment `split` of this tile's keys [kv_start, kv_end).

    The tile's ceil((kv_end - kv_start) / TILE_N) key tiles (kv_start a multiple of
    TILE_N) are dealt out in equal runs of ceil(n_tiles / num_splits); the last segments
    may be short or empty (seg_start >= seg_end) when the context is short. Lengths come
    from seq_lens on the device, so num_splits alone fixes the launch shape.
    """
    tiles_per_split = tl.cdiv(tl.cdiv(kv_end - kv_start, TILE_N), num_splits)
    seg_start = kv_start + split * tiles_per_split * TILE_N
    seg_end = tl.minimum(kv_end, seg_start + tiles_per_split * TILE_N)
    return seg_start, seg_end


@triton.jit
def _store_partial(part_o_ptr, part_m_ptr, part_l_ptr, tok, head, split, acc, m_i, l_i,
                   row_valid, io_mask, offs_d, stride_p_tok, stride_p_head, stride_ml_tok,
                   stride_ml_head, HEAD_DIM: tl.constexpr):
    """Write one segment's normalised output and its (max, sum) for the reduce pass.

    part_o: [num_tokens, num_heads, num_splits, head_dim] fp32 (split stride = head_dim)
    part_m, part_l: [num_tokens, num_heads, num_splits] fp32 (split stride = 1)
    tok, head, row_valid: [BLOCK_M]; acc: [BLOCK_M, HEAD_DIM_P]
    """
    ml_off = tok * stride_ml_tok + head * stride_ml_head + split  # [BLOCK_M]
    tl.store(part_m_ptr + ml_off, m_i, mask=row_valid)
    tl.store(part_l_ptr + ml_off, l_i, mask=row_valid)
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # rows with l_i == 0 store 0, weight 0
    p_off = tok * stride_p_tok + head * stride_p_head + split * HEAD_DIM  # [BLOCK_M]
    tl.store(part_o_ptr + p_off[:, None] + offs_d[None, :], o, mask=io_mask)


# Batch-shape scalars change every step; specialising on them (== 1, % 16)
# would compile new variants mid-run, e.g. during CUDA-graph capture.
@triton.jit(do_not_specialize=["num_seqs", "max_blocks", "stride_bt_seq", "num_splits",
                               "stride_p_tok", "stride_ml_tok"])
def paged_attention_kernel(
    out_ptr,           # [num_tokens, num_heads, head_dim]
    query_ptr,         # [num_tokens, num_heads, head_dim]  (strided view allowed)
    k_cache_ptr,       # [num_blocks, block_size, num_kv_heads, head_dim]  contiguous
    v_cache_ptr,       # [num_blocks, block_size, num_kv_heads, head_dim]  contiguous
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq]
    seq_lens_ptr,      # [num_seqs]
    cu_seqlens_q_ptr,  # [num_seqs + 1]
    part_o_ptr,        # SPLIT: [num_tokens, num_heads, num_splits, head_dim] fp32 (else unused)
    part_m_ptr,        # SPLIT: [num_tokens, num_heads, num_splits] fp32 running max (log2)
    part_l_ptr,        # SPLIT: [num_tokens, num_heads, num_splits] fp32 running sum
    sinks_ptr,         # HAS_SINKS: [num_heads] logits (else unused)
    k_scale_ptr,       # FP8_KV: [1] fp32, cached K = e4m3 value * k_scale (else unused)
    v_scale_ptr,       # FP8_KV: [1] fp32, cached V = e4m3 value * v_scale (else unused)
    scale_log2,        # softmax_scale * log2(e): exp2 is cheaper than exp
    soft_cap_log2,     # SOFT_CAP: logits_soft_cap * log2(e) (else unused)
    sliding_window,    # SLIDING: a row at p sees keys p - sliding_window + 1 .. p (else unused)
    num_seqs, max_blocks, num_splits,
    stride_q_tok, stride_q_head, stride_q_dim,
    stride_o_tok, stride_o_head, stride_o_dim,
    stride_c_blk, stride_c_pos, stride_c_head,  # shared: both caches same shape, contiguous
    stride_bt_seq,
    stride_p_tok, stride_p_head,    # part_o (contiguous; split stride = head_dim)
    stride_ml_tok, stride_ml_head,  # part_m / part_l (contiguous; split stride = 1)
    GROUP: tl.constexpr,       # query heads per kv head
    GROUP_P: tl.constexpr,     # GROUP rounded up to a power of two
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,  # HEAD_DIM rounded up to a power of two (masked)
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    BLOCK_Q: tl.constexpr,     # query rows (tokens) per program
    TILE_N: tl.constexpr,      # keys per inner-loop step
    ONE_BLOCK_TILES: tl.constexpr,  # TILE_N divides BLOCK_SIZE: cheaper addressing
    UPCAST: tl.constexpr,      # run the dots in fp32 (interpreter lacks bf16 dot)
    IEEE_DOT: tl.constexpr,    # exact fp32 dots instead of tf32
    SPLIT: tl.constexpr,       # split-KV: program_id(2) is the segment; write partials
    SLIDING: tl.constexpr,     # sliding-window attention
    SOFT_CAP: tl.constexpr,    # logit soft-capping
    HAS_SINKS: tl.constexpr,   # attention sinks
    FP8_KV: tl.constexpr,      # the caches are e4m3 with per-tensor scales
):
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_P
    kv_head = tl.program_id(1)
    seq, q_start, q_len, tile_in_seq, seq_len = _locate_tile(
        cu_seqlens_q_ptr, seq_lens_ptr, tl.program_id(0), num_seqs, BLOCK_Q)
    if tile_in_seq * BLOCK_Q >= q_len:
        return

    offs_m = tl.arange(0, BLOCK_M)  # [BLOCK_M] row = (query row, head in group)
    q_row = tile_in_seq * BLOCK_Q + offs_m // GROUP_P  # [BLOCK_M] row inside the chunk
    head = kv_head * GROUP + offs_m % GROUP_P  # [BLOCK_M]
    offs_d = tl.arange(0, HEAD_DIM_P)  # [HEAD_DIM_P]
    d_valid = offs_d < HEAD_DIM
    tok = (q_start + q_row).to(tl.int64)  # [BLOCK_M]
    row_valid = (q_row < q_len) & (offs_m % GROUP_P < GROUP)  # [BLOCK_M]
    io_mask = row_valid[:, None] & d_valid[None, :]
    q = tl.load(query_ptr + tok[:, None] * stride_q_tok + head[:, None] * stride_q_head
                + offs_d[None, :] * stride_q_dim, mask=io_mask, other=0.0)  # [BLOCK_M, HEAD_DIM_P]
    if UPCAST:
        q = q.to(tl.float32)

    # Row i sees keys 0..ctx_len + i (ctx_len = cached prefix); no key past
    # the tile's last row is needed.
    ctx_len = seq_len - q_len
    q_horizon = ctx_len + q_row  # [BLOCK_M]
    kv_end = ctx_len + tl.minimum(q_len, (tile_in_seq + 1) * BLOCK_Q)
    kv_start = 0
    if SLIDING:  # the tile's first row sees the earliest keys; tiles before its window are skipped
        first_key = tl.maximum(ctx_len + tile_in_seq * BLOCK_Q - sliding_window + 1, 0)
        kv_start = first_key // TILE_N * TILE_N
    if SPLIT:
        kv_start, kv_end = _segment(kv_start, kv_end, tl.program_id(2), num_splits, TILE_N)
    bt_row_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    if FP8_KV:  # scores of the stored K come out k_scale times too small
        scale_log2 = scale_log2 * tl.load(k_scale_ptr)
    acc, m_i, l_i = _attend(
        q, k_cache_ptr, v_cache_ptr, bt_row_ptr, max_blocks, kv_head * stride_c_head,
        stride_c_blk, stride_c_pos, kv_start, kv_end, q_horizon, scale_log2, sliding_window,
        soft_cap_log2, offs_d, d_valid, BLOCK_M, HEAD_DIM_P, BLOCK_SIZE, TILE_N,
        ONE_BLOCK_TILES, IEEE_DOT, SLIDING, SOFT_CAP)
    if FP8_KV:
        acc = acc * tl.load(v_scale_ptr)
    if HAS_SINKS:  # unsplit, program_id(2) is always 0
        acc, m_i, l_i = _fold_sink(acc, m_i, l_i, sinks_ptr, head, row_valid,
                                   tl.program_id(2) == 0)
    if SPLIT:
        _store_partial(part_o_ptr, part_m_ptr, part_l_ptr, tok, head, tl.program_id(2), acc,
                       m_i, l_i, row_valid, io_mask, offs_d, stride_p_tok, stride_p_head,
                       stride_ml_tok, stride_ml_head, HEAD_DIM)
    else:
        # Padding rows (l_i == 0) are masked on store; the guard only avoids 0/0.
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + tok[:, None] * stride_o_tok + head[:, None] * stride_o_head
                 + offs_d[None, :] * stride_o_dim, o.to(out_ptr.dtype.element_ty), mask=io_mask)
