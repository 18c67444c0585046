"""Paged attention: Triton kernel and fast torch path against the reference.

On CPU the Triton kernel runs under the Triton interpreter (TRITON_INTERPRET=1
must be set before triton is imported); on a CUDA machine the same cases run
natively, plus larger ones.
"""

import math

import pytest
import torch

from tests.triton_device import DEVICE  # before kernels: sets the interpreter up

import kernels  # noqa: E402
from kernels import paged_attention, paged_attention_ref, paged_attention_torch  # noqa: E402
from tests.test_kernels_cpu_attention import poison_before_windows  # noqa: E402

TOL = {torch.float32: 2e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def make_batch(q_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype,
               num_blocks=None, first_block=0, seed=0, device=DEVICE):
    """Random paged batch; each sequence gets shuffled, non-contiguous block ids.

    Returns dict of paged_attention kwargs:
      query [num_tokens, num_heads, head_dim], k_cache/v_cache
      [num_blocks, block_size, num_kv_heads, head_dim], block_tables
      [num_seqs, max_blocks], seq_lens [num_seqs], cu_seqlens_q [num_seqs + 1].
    Blocks of the cache not owned by any sequence hold garbage (large values)
    so that reading one shows up in the comparison.
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [math.ceil(n / block_size) for n in seq_lens]
    used = sum(blocks_per_seq)
    total = num_blocks if num_blocks is not None else used + 4
    ids = first_block + torch.randperm(total - first_block, generator=gen)[:used]
    table = torch.zeros(len(seq_lens), max(blocks_per_seq) + 1, dtype=torch.int32)
    pos = 0
    for s, n in enumerate(blocks_per_seq):
        table[s, :n] = ids[pos:pos + n]
        pos += n
    shape = (total, block_size, num_kv_heads, head_dim)
    if num_blocks is None:
        k_cache = torch.full(shape, 1e4, dtype=dtype)
        v_cache = torch.full(shape, 1e4, dtype=dtype)
        k_cache[ids] = torch.randn((used,) + shape[1:], generator=gen).to(dtype)
        v_cache[ids] = torch.randn((used,) + shape[1:], generator=gen).to(dtype)
        k_cache, v_cache = k_cache.to(device), v_cache.to(device)
    else:
        # Huge cache: allocate without touching memory; fill only the used blocks.
        k_cache = torch.empty(shape, dtype=dtype, device=device)
        v_cache = torch.empty(shape, dtype=dtype, device=device)
        dev_ids = ids.to(device)
        k_cache[dev_ids] = torch.randn((used,) + shape[1:], generator=gen).to(dtype).to(device)
        v_cache[dev_ids] = torch.randn((used,) + shape[1:], generator=gen).to(dtype).to(device)
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    query = torch.randn(cu[-1], num_heads, head_dim, generator=gen).to(dtype)
    return dict(
        query=query.to(device), k_cache=k_cache, v_cache=v_cache,
        block_tables=table.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
        max_seqlen_q=max(q_lens), softmax_scale=1.0 / math.sqrt(head_dim),
    )


def check_against_ref(batch, dtype, backends=("triton", "torch"), **triton_kwargs):
    """Each backend's output against the reference; triton_kwargs go to the Triton call only."""
    ref = paged_attention_ref(**batch)
    tol = TOL[dtype]
    for name in backends:
        fn = paged_attention if name == "triton" else paged_attention_torch
        # NaN poison: any row the kernel forgets to write fails the test.
        out = torch.full_like(batch["query"], float("nan"))
        got = fn(**batch, out=out, **(triton_kwargs if name == "triton" else {}))
        assert got is out, name
        assert not torch.isnan(out).any(), f"{name}: rows left unwritten (NaN)"
        torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol, msg=name)


# (q_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size)
CASES = {
    "decode_len1": ([1], [1], 4, 4, 64, 16),
    "decode_block_edges_bs16": ([1, 1, 1], [15, 16, 17], 4, 2, 64, 16),
    "decode_block_edges_bs32_mqa": ([1, 1, 1], [31, 32, 33], 4, 1, 64, 32),
    "prefill_block_edges": ([15, 16, 17], [15, 16, 17], 2, 2, 64, 16),
    "prefill_chunk_with_prefix_d80": ([7, 20], [40, 52], 8, 2, 80, 16),
    "mixed_gqa8_d128_bs32": ([1, 9, 1, 33, 1], [50, 9, 17, 70, 1], 8, 1, 128, 32),
    "mixed_gqa4_d96": ([3, 1, 12], [3, 30, 45], 8, 2, 96, 16),
    # Block sizes the tiles cannot sit inside: per-key block lookups.
    "gather_bs8": ([1, 6], [21, 30], 4, 2, 64, 8),
    "gather_bs24": ([1, 5, 1], [24, 49, 25], 4, 4, 80, 24),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_cases(case, dtype):
    q_lens, seq_lens, heads, kv_heads, head_dim, block_size = CASES[case]
    batch = make_batch(q_lens, seq_lens, heads, kv_heads, head_dim, block_size, dtype)
    check_against_ref(batch, dtype)


def _random_case(seed):
    rng = torch.Generator().manual_seed(1000 + seed)

    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=rng))]

    kv_heads = pick([1, 2])
    heads = kv_heads * pick([1, 2, 4, 8])
    q_lens, seq_lens = [], []
    for _ in range(int(torch.randint(1, 5, (1,), generator=rng))):
        q_len = pick([1, 1, 2, 5, 16, 17])
        prefix = pick([0, 0, 1, 15, 31, 40])
        q_lens.append(q_len)
        seq_lens.append(q_len + prefix)
    return q_lens, seq_lens, heads, kv_heads, pick([64, 80, 128]), pick([16, 32])


@pytest.mark.parametrize("seed", range(6))
def test_random_shapes(seed):
    dtype = DTYPES[seed % 3]
    q_lens, seq_lens, heads, kv_heads, head_dim, block_size = _random_case(seed)
    batch = make_batch(q_lens, seq_lens, heads, kv_heads, head_dim, block_size, dtype, seed=seed)
    check_against_ref(batch, dtype)


def test_strided_query_view_of_fused_qkv():
    heads, kv_heads, head_dim = 4, 2, 64
    batch = make_batch([1, 6], [20, 6], heads, kv_heads, head_dim, 16, torch.float32)
    q = batch["query"]  # [num_tokens, heads, head_dim]
    # qkv: [num_tokens, (heads + 2 * kv_heads) * head_dim]; query is a strided view into it.
    qkv = torch.randn(q.shape[0], (heads + 2 * kv_heads) * head_dim, device=DEVICE)
    qkv[:, : heads * head_dim] = q.reshape(q.shape[0], -1)
    batch["query"] = qkv[:, : heads * head_dim].view(q.shape[0], heads, head_dim)
    assert not batch["query"].is_contiguous()
    check_against_ref(batch, torch.float32)


def test_torch_path_uses_host_lengths():
    batch = make_batch([1, 5, 1], [9, 20, 64], 4, 2, 64, 16, torch.float32)
    ref = paged_attention_ref(**batch)
    got = paged_attention_torch(**batch, seq_lens_cpu=[9, 20, 64], query_lens_cpu=[1, 5, 1])
    torch.testing.assert_close(got, ref, atol=2e-4, rtol=2e-4)
    with pytest.raises(ValueError, match="query lengths"):
        paged_attention_torch(**batch, seq_lens_cpu=[9, 20, 64], query_lens_cpu=[1, 5, 2])


def test_decode_buckets_with_skewed_lengths():
    # One long decode among short ones lands in its own length bucket.
    batch = make_batch([1] * 5, [3, 130, 17, 1, 64], 4, 4, 64, 16, torch.float32)
    check_against_ref(batch, torch.float32, backends=("torch",))


def test_cache_offsets_beyond_int32():
    """Blocks past id 32768 with 65536 elements per block: offsets exceed 2**31.

    The caches are ~4.4 GB each but only the used blocks are ever touched, so
    the resident memory stays small (the rest is never-faulted virtual memory).
    """
    block_size, kv_heads, head_dim = 32, 8, 256  # 65536 elements per block
    num_blocks = 32800
    try:
        batch = make_batch([1, 4], [40, 70], 8, kv_heads, head_dim, block_size, torch.float16,
                           num_blocks=num_blocks, first_block=32769)
    except (RuntimeError, MemoryError) as exc:  # no room for the virtual reservation
        pytest.skip(f"cannot reserve the large cache: {exc}")
    assert int(batch["block_tables"][:, :2].min()) > 32768
    assert num_blocks * block_size * kv_heads * head_dim > 2**31
    check_against_ref(batch, torch.float16)


def test_empty_batch_returns_out():
    batch = make_batch([1], [4], 2, 2, 64, 16, torch.float32)
    batch.update(query=batch["query"][:0], block_tables=batch["block_tables"][:0],
                 seq_lens=batch["seq_lens"][:0], cu_seqlens_q=batch["cu_seqlens_q"][:1])
    for fn in (paged_attention, paged_attention_torch):
        assert fn(**batch).shape == (0, 2, 64)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 80, 128, 256])
def test_gpu_realistic(dtype, head_dim):
    gen = torch.Generator().manual_seed(head_dim)
    decode_ctx = torch.randint(1, 1500, (48,), generator=gen).tolist()
    q_lens = [1] * 48 + [512, 300, 1, 77]
    seq_lens = decode_ctx + [512, 900, 2048, 1100]
    batch = make_batch(q_lens, seq_lens, 32, 8, head_dim, 16, dtype, seed=head_dim)
    check_against_ref(batch, dtype)


def test_torch_path_without_sdpa_enable_gqa(monkeypatch):
    # torch < 2.5 has no enable_gqa: prefill chunks then repeat K/V per head.
    import kernels.torch_attention as ta
    monkeypatch.setattr(ta, "_SDPA_HAS_GQA", False)
    batch = make_batch([1, 7, 12], [30, 7, 40], 8, 2, 64, 16, torch.float32)
    check_against_ref(batch, torch.float32, backends=("torch",))


def test_torch_path_reuses_workspace_across_sizes():
    import kernels.torch_attention as ta
    ta.clear_workspace()
    for q_lens, seq_lens in (([1, 1], [70, 90]), ([1, 3], [5, 9]), ([1, 40], [200, 100])):
        batch = make_batch(q_lens, seq_lens, 4, 2, 64, 16, torch.float32, seed=len(seq_lens))
        check_against_ref(batch, torch.float32, backends=("torch",))


# Sliding window, soft cap, sinks: (q_lens, seq_lens, heads, kv_heads, head_dim, block_size,
# sliding_window, logits_soft_cap, sinks)
SCORE_CASES = {
    "decode_window_shorter_than_block": ([1, 1, 1], [3, 17, 40], 4, 2, 64, 16, 5, None, False),
    "decode_window_spans_blocks": ([1, 1], [90, 37], 4, 1, 64, 16, 37, None, False),
    "window_of_one": ([1, 5], [20, 30], 2, 2, 64, 16, 1, None, False),
    "prefill_window": ([40], [40], 4, 2, 64, 16, 7, None, False),
    "chunk_with_prefix_window": ([9, 1], [50, 60], 4, 2, 64, 16, 20, None, False),
    "mixed_window_gather_bs8": ([1, 6, 12], [30, 21, 12], 4, 2, 64, 8, 11, None, False),
    "soft_cap": ([1, 9], [30, 20], 4, 2, 64, 16, None, 2.0, False),
    "sinks": ([1, 9], [30, 20], 4, 2, 64, 16, None, None, True),
    "all_three": ([1, 7, 1], [70, 30, 5], 4, 2, 64, 16, 13, 3.0, True),
}


def score_batch(case, dtype=torch.float32, seed=0):
    """make_batch plus the case's sliding_window / logits_soft_cap / sinks arguments."""
    q_lens, seq_lens, heads, kv_heads, head_dim, block_size, window, cap, sinks = SCORE_CASES[case]
    batch = make_batch(q_lens, seq_lens, heads, kv_heads, head_dim, block_size, dtype, seed=seed)
    gen = torch.Generator().manual_seed(seed + 7)
    sink_logits = (2 * torch.randn(heads, generator=gen)).to(DEVICE) if sinks else None
    return dict(batch, sliding_window=window, logits_soft_cap=cap, sinks=sink_logits)


@pytest.mark.parametrize("case", list(SCORE_CASES), ids=list(SCORE_CASES))
def test_score_options(case):
    check_against_ref(score_batch(case), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_score_options_half(dtype):
    check_against_ref(score_batch("all_three", dtype, seed=3), dtype)


def test_blocks_before_the_window_are_never_read():
    """Triton skips the tiles before a window, split or not (the torch path skips those
    blocks too, but its decode buckets pad with other sequences' blocks: finite poison)."""
    batch = make_batch([1, 9, 1], [90, 60, 40], 4, 2, 64, 16, torch.float32)
    batch.update(sliding_window=20, logits_soft_cap=None, sinks=torch.randn(4).to(DEVICE))
    ref = paged_attention_ref(**batch)
    poison_before_windows(batch)
    assert batch["k_cache"].isnan().sum() == (4 + 2 + 1) * 16 * 2 * 64  # blocks before 70, 32, 20
    for num_splits in (1, 3):
        out = paged_attention(**batch, num_splits=num_splits)
        torch.testing.assert_close(out, ref, atol=2e-4, rtol=2e-4)
    out = paged_attention_torch(**poison_before_windows(batch, 1e4))
    torch.testing.assert_close(out, ref, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("name, value, message", [
    ("sliding_window", 0, "sliding_window must be None or a python int >= 1, got 0"),
    ("sliding_window", 2.0, "sliding_window must be None or a python int >= 1, got 2.0"),
    ("logits_soft_cap", 0.0, "logits_soft_cap must be finite and > 0, got 0.0"),
    ("logits_soft_cap", -1, "logits_soft_cap must be finite and > 0, got -1"),
    ("sinks", torch.zeros(3), r"sinks has shape \(3,\); expected \[num_heads\] = \[4\]"),
    ("sinks", torch.zeros(4, 1), "sinks must be 1-D"),
])
def test_bad_score_options_are_refused(name, value, message):
    batch = dict(score_batch("sinks"), **{name: value})
    for fn in (paged_attention, paged_attention_torch):
        with pytest.raises(ValueError, match=message):
            fn(**batch)
