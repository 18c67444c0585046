"""Split-KV ("flash-decoding") for the Triton paged-attention kernel: when, and the reduce.

A decode launch has one query tile per sequence, so the main kernel runs only
num_seqs x num_kv_heads programs; 4 sequences x 8 KV heads leave 100 of an
H100's 132 SMs idle, and each busy one walks the whole context alone. With
num_splits > 1 the grid gains a third axis: program (q_tile, kv_head, split)
attends over one segment of the tile's keys and writes, per score row,

    part_o [num_tokens, num_heads, num_splits, head_dim]  fp32  segment output, normalised
    part_m [num_tokens, num_heads, num_splits]            fp32  running max (log2 domain)
    part_l [num_tokens, num_heads, num_splits]            fp32  sum of exp2(score - max)

and `reduce_splits_kernel` merges the segments of each (token, head):

    M = max_s m_s,   w_s = l_s * exp2(m_s - M),   out = sum_s w_s * o_s / sum_s w_s

A segment a row cannot see (past its causal horizon, before its sliding
window, or past a short sequence's end) has l_s = 0 and so weight 0. With a
window, the segments divide only the keys from the tile holding the first
row's first visible key on; sinks are folded into segment 0 alone.

Segment lengths are decided on the device per sequence (kernel `_segment`:
the keys' tiles dealt out in equal runs), so a short context spread over many
splits costs only empty programs; num_splits itself comes from host-known
values only (batch shape, the block table's width, the SM count), which keeps
the launch shape fixed under CUDA-graph capture. The scratch is allocated per
call from torch's caching allocator (inside a graph capture, from the graph's
pool, so each replay reuses the same addresses); no host sync anywhere.
"""

import functools

import torch
import triton
import triton.language as tl

# Heuristic knobs (module-level so loadtest.kernel_bench can sweep them; tuned
# values need an H100 run, see docs/benchmarks.md).
SPLIT_MAX_SEQLEN_Q = 1      # split only launches whose query chunks are at most this long
SPLIT_TARGET_WAVES = 2      # aim for this many programs per SM
MIN_SEGMENT_LEN = 256       # keys: shorter segments cost more in scratch + reduce than they save
MAX_SPLITS = 16
INTERPRETER_NUM_SMS = 4     # stand-in SM count off CUDA (TRITON_INTERPRET=1 runs)
REDUCE_TILE_ELEMS = 8192    # fp32 values one reduce program holds (sets its heads per program)
MAX_FORCED_SPLITS = 256     # bound on an explicit num_splits (the reduce holds all splits at once)

NEG_BIG = tl.constexpr(-1.0e30)  # matches the main kernel's finite "minus infinity"


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; INTERPRETER_NUM_SMS elsewhere."""
    if device.type != "cuda":
        return INTERPRETER_NUM_SMS
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_sm_count(index)


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seqlen_q: int,
                      max_seqlen_k: int, sms: int) -> int:
    """Segments per sequence for one launch; 1 means the plain (unsplit) kernel.

    max_seqlen_k is a host-side bound on the context (the block table's width
    x block_size), never read from seq_lens: under CUDA graphs it is the same
    for every replay. Split when the launch is decode-only and its
    num_seqs x num_kv_heads programs would leave SMs idle: enough segments to
    reach SPLIT_TARGET_WAVES programs per SM, as many as the context bound
    allows at MIN_SEGMENT_LEN keys each (so long contexts take the most
    splits), at most MAX_SPLITS.
    """
    if max_seqlen_q > SPLIT_MAX_SEQLEN_Q:
        return 1  # prefill tiles already give the grid its width
    programs = max(1, num_seqs * num_kv_heads)
    wanted = triton.cdiv(SPLIT_TARGET_WAVES * sms, programs)
    by_length = triton.cdiv(max_seqlen_k, MIN_SEGMENT_LEN)
    return max(1, min(wanted, by_length, MAX_SPLITS))


def check_num_splits(num_splits) -> None:
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) \
            or not 1 <= num_splits <= MAX_FORCED_SPLITS:
        raise ValueError(f"num_splits must be a python int in 1..{MAX_FORCED_SPLITS} "
                         f"or None (heuristic), got {num_splits!r}")


def segment_bounds(kv_len: int, num_splits: int, tile_n: int, kv_start: int = 0) -> list:
    """Host mirror of the kernel's `_segment` rule (tests, docs): [(start, end)] per split of
    keys [kv_start, kv_len), kv_start a multiple of tile_n (nonzero with a sliding window)."""
    per = triton.cdiv(triton.cdiv(kv_len - kv_start, tile_n), num_splits) * tile_n
    return [(kv_start + s * per, min(kv_len, kv_start + (s + 1) * per)) for s in range(num_splits)]


def alloc_partials(num_tokens: int, num_heads: int, head_dim: int, num_splits: int, device):
    """(part_o, part_m, part_l) scratch, layouts as in the module docstring."""
    part_o = torch.empty(num_tokens, num_heads, num_splits, head_dim, dtype=torch.float32,
                         device=device)
    part_ml = torch.empty(2, num_tokens, num_heads, num_splits, dtype=torch.float32,
                          device=device)
    return part_o, part_ml[0], part_ml[1]


@triton.jit(do_not_specialize=["num_rows", "num_heads", "num_splits"])
def reduce_splits_kernel(
    out_ptr,     # [num_tokens, num_heads, head_dim]  query's dtype
    part_o_ptr,  # [num_tokens * num_heads, num_splits, head_dim] fp32, contiguous
    part_m_ptr,  # [num_tokens * num_heads, num_splits] fp32, contiguous
    part_l_ptr,  # [num_tokens * num_heads, num_splits] fp32, contiguous
    num_rows, num_heads, num_splits,
    stride_o_tok, stride_o_head, stride_o_dim,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,  # HEAD_DIM rounded up to a power of two (masked)
    SPLITS_P: tl.constexpr,    # num_splits rounded up to a power of two (masked)
    BLOCK_R: tl.constexpr,     # (token, head) rows per program (power of two, masked)
):
    """Program i: merge the num_splits segment results of rows [i * BLOCK_R, (i + 1) * BLOCK_R)."""
    row = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R]
    offs_s = tl.arange(0, SPLITS_P)  # [SPLITS_P]
    valid = (row < num_rows)[:, None] & (offs_s < num_splits)[None, :]  # [BLOCK_R, SPLITS_P]
    ml_off = row[:, None] * num_splits + offs_s[None, :]
    m = tl.load(part_m_ptr + ml_off, mask=valid, other=NEG_BIG)  # [BLOCK_R, SPLITS_P]
    l = tl.load(part_l_ptr + ml_off, mask=valid, other=0.0)
    w = l * tl.exp2(m - tl.max(m, axis=1)[:, None])  # 0 for empty segments
    offs_d = tl.arange(0, HEAD_DIM_P)
    d_valid = offs_d < HEAD_DIM
    # Empty segments are never read: their weight is 0 anyway.
    o = tl.load(part_o_ptr + ml_off[:, :, None] * HEAD_DIM + offs_d[None, None, :],
                mask=(valid & (l > 0))[:, :, None] & d_valid[None, None, :],
                other=0.0)  # [BLOCK_R, SPLITS_P, HEAD_DIM_P]
    denom = tl.sum(w, axis=1)  # [BLOCK_R]
    res = tl.sum(o * w[:, :, None], axis=1) / tl.where(denom > 0, denom, 1.0)[:, None]
    tok, head = row // num_heads, row % num_heads
    tl.store(out_ptr + (tok * stride_o_tok + head * stride_o_head)[:, None]
             + offs_d[None, :] * stride_o_dim, res.to(out_ptr.dtype.element_ty),
             mask=(row < num_rows)[:, None] & d_valid[None, :])


def reduce_splits(out, part_o, part_m, part_l) -> None:
    """Launch the merge: out[t, h] = the softmax-weighted mix of part_o[t, h, :]."""
    num_tokens, num_heads, num_splits, head_dim = part_o.shape
    splits_p, head_dim_p = triton.next_power_of_2(num_splits), triton.next_power_of_2(head_dim)
    num_rows = num_tokens * num_heads
    # A program holds BLOCK_R x SPLITS_P x HEAD_DIM_P fp32 values in registers. The
    # interpreter pays per program, not per element: there, take as many rows as fit.
    tile = REDUCE_TILE_ELEMS if out.device.type == "cuda" else 1 << 20
    block_r = min(triton.next_power_of_2(num_rows), max(1, tile // (splits_p * head_dim_p)))
    reduce_splits_kernel[(triton.cdiv(num_rows, block_r),)](
        out, part_o, part_m, part_l, num_rows, num_heads, num_splits,
        out.stride(0), out.stride(1), out.stride(2),
        HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p, SPLITS_P=splits_p, BLOCK_R=block_r,
        num_warps=4,
    )
