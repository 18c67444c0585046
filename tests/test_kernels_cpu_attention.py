"""The CPU path's fused C paged-attention kernel (kernels.cpu_attention) against the reference.

Caches are poisoned: blocks no sequence owns, and the rows past a sequence's end
in its last block, hold NaN, and `out` starts as NaN, so a stray read or an
unwritten row fails the comparison.

bf16 and fp16 run the same cases: the kernel widens them to fp32 and the reference
computes in fp32 from the same values, so the two differ only by fp32 summation order
(~1e-6) before each rounds its output once; that can move an output by one ulp of
its type, 2^-7 of its magnitude at most for bf16 (8 significant bits), 2^-10 for fp16.
"""
import ctypes
import math
import platform
import shutil
from pathlib import Path

import pytest
import torch

from kernels import cpu_attention, cpu_build
from kernels.cpu_attention import (AMX_BF16_KERNEL_MAX_Q_LEN, KERNEL_MAX_Q_LEN, kernel_available,
                                   kernel_max_q_len, paged_attention_cpu, store_kv_cpu)
from kernels.reference import paged_attention_ref, store_kv_ref
from kernels.torch_attention import ScoreOptions

TOL = 2e-5  # fp32: summation order only (outputs are ~1)
# (atol, rtol) per dtype: fp32's TOL, plus one ulp of the half types (see the docstring).
TOLS = {torch.float32: (TOL, TOL), torch.bfloat16: (TOL, 2**-7), torch.float16: (TOL, 2**-10)}
DTYPES = list(TOLS)
# SDPA's rows (long and fresh chunks; torch's code, not the kernel) in a half type: it rounds
# the probabilities to that type before P @ V, so an output may be off by about one ulp of the
# values it averages; randn values are below 8, whose ulp is 2^-5 in bf16 and 2^-8 in fp16.
SDPA_TOLS = {torch.bfloat16: (2**-5, 2**-7), torch.float16: (2**-8, 2**-10)}
needs_kernel = pytest.mark.skipif(not kernel_available(), reason="the C kernel could not be built here")


def make_batch(q_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size=16,
               num_blocks=None, first_block=0, seed=0, poison=float("nan"), dtype=torch.float32):
    """paged_attention kwargs for a random batch on shuffled, non-contiguous blocks, in `dtype`.

    `poison` fills what no sequence may read. The torch fallback needs it finite: it
    reads whole blocks and masks, and 0 * NaN is NaN (the engine zero-fills its cache)."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = [math.ceil(n / block_size) for n in seq_lens]
    total = num_blocks or sum(per_seq) + 3
    ids = first_block + torch.randperm(total - first_block, generator=gen)[:sum(per_seq)]
    table = torch.zeros(len(seq_lens), max(per_seq) + 2, dtype=torch.int32)
    shape = (total, block_size, num_kv_heads, head_dim)
    # torch.empty: a huge cache stays virtual; only the blocks written below are touched.
    k_cache, v_cache = torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=dtype)
    if num_blocks is None:
        k_cache.fill_(poison)
        v_cache.fill_(poison)
    pos = 0
    for s, (n_blocks, seq_len) in enumerate(zip(per_seq, seq_lens)):
        mine = ids[pos:pos + n_blocks]
        table[s, :n_blocks] = mine
        pos += n_blocks
        for cache in (k_cache, v_cache):
            rows = torch.randn((n_blocks * block_size, num_kv_heads, head_dim), generator=gen)
            rows[seq_len:] = poison  # past the end: never to be read
            cache[mine] = rows.view(n_blocks, block_size, num_kv_heads, head_dim).to(dtype)
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    query = torch.randn(cu[-1], num_heads, head_dim, generator=gen).to(dtype)
    return dict(query=query, k_cache=k_cache,
                v_cache=v_cache, block_tables=table, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                cu_seqlens_q=torch.tensor(cu, dtype=torch.int32), max_seqlen_q=max(q_lens),
                softmax_scale=1.0 / math.sqrt(head_dim))


def kernel_rows(batch):
    """[num_tokens] bool: the rows the row kernel computes (chunks of up to kernel_max_q_len rows,
    fresh or with a prefix; longer ones go to the AMX chunk kernel or SDPA, both of which round P
    to bf16)."""
    opts = ScoreOptions(**{k: batch.get(k) for k in ("sliding_window", "logits_soft_cap", "sinks")})
    cu, limit = batch["cu_seqlens_q"].tolist(), kernel_max_q_len(batch["query"].dtype, batch["query"].shape[-1], opts)
    rows = torch.zeros(cu[-1], dtype=torch.bool)
    for s in range(len(cu) - 1):
        rows[cu[s]:cu[s + 1]] = cu[s + 1] - cu[s] <= limit
    return rows


def assert_close(out, ref, batch, extra):
    """The kernel's rows within TOLS; SDPA's in a half type within SDPA_TOLS."""
    mine = kernel_rows(batch)
    atol, rtol = TOLS[ref.dtype]
    torch.testing.assert_close(out[mine], ref[mine], atol=atol, rtol=rtol)
    atol, rtol = SDPA_TOLS.get(ref.dtype, (atol, rtol))
    torch.testing.assert_close(out[~mine], ref[~mine], atol=atol, rtol=rtol)


def check(batch, **extra):
    ref = paged_attention_ref(**batch)
    out = torch.full_like(batch["query"], float("nan"))
    got = paged_attention_cpu(**batch, out=out, **extra)
    assert got is out
    assert not torch.isnan(out).any(), "rows left unwritten, or a poisoned row was read"
    assert_close(out, ref, batch, extra)


def poison_before_windows(batch, value=float("nan")):
    """Fill the blocks wholly before each sequence's first query row's window with `value`.

    No row may read them: with NaN, a kernel that loads one (even masked: 0 * NaN) fails.
    """
    block_size = batch["k_cache"].shape[1]
    cu = batch["cu_seqlens_q"].tolist()
    for s, seq_len in enumerate(batch["seq_lens"].tolist()):
        first_key = max(0, seq_len - (cu[s + 1] - cu[s]) - batch["sliding_window"] + 1)
        hidden = batch["block_tables"][s, :first_key // block_size].long()
        batch["k_cache"][hidden] = value
        batch["v_cache"][hidden] = value
    return batch


def check_windowed(batch, **extra):
    """check() with the blocks before every window poisoned after the reference ran: the
    kernel must skip them, not only mask them."""
    ref = paged_attention_ref(**batch)
    poison_before_windows(batch)
    out = torch.full_like(batch["query"], float("nan"))
    paged_attention_cpu(**batch, out=out, **extra)
    assert not torch.isnan(out).any(), "rows left unwritten, or a block before the window was read"
    assert_close(out, ref, batch, extra)


# Decode lengths around the 16-row block and 16-key vector edges, short to long.
DECODE_LENS = [1, 2, 15, 16, 17, 31, 32, 33, 100, 128, 129, 300]


@needs_kernel
@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 2, 3, 4, 6, 8])  # 3, 6: groups of query heads past the kernel's 4
def test_decode_mixed_lengths(group, head_dim, dtype):
    batch = make_batch([1] * len(DECODE_LENS), DECODE_LENS, 2 * group, 2, head_dim, seed=group, dtype=dtype)
    check(batch)


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [8, 16, 24, 32])
def test_block_sizes_around_the_vector_width(block_size, dtype):
    # 8 and 24 are not multiples of the kernel's 16-key vectors: the row-by-row path.
    lens = [block_size - 1, block_size, block_size + 1, 3 * block_size + 5]
    check(make_batch([1, 1, 1, 1], lens, 4, 2, 64, block_size=block_size, dtype=dtype))


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [40, 72])
def test_head_dim_not_a_multiple_of_16(head_dim, dtype):
    check(make_batch([1, 1, 3], [17, 50, 40], 4, 2, head_dim, dtype=dtype))


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
def test_chunks_with_a_cached_prefix_and_fresh_chunks(dtype):
    # q_len 1..KERNEL_MAX_Q_LEN run in the kernel (with or without a prefix); longer ones in SDPA.
    q_lens = [1, 2, 5, 16, KERNEL_MAX_Q_LEN, KERNEL_MAX_Q_LEN + 7, 20, 3]
    seq_lens = [40, 30, 5, 60, KERNEL_MAX_Q_LEN + 9, KERNEL_MAX_Q_LEN + 50, 20, 3]
    check(make_batch(q_lens, seq_lens, 8, 2, 64, dtype=dtype))


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
def test_fresh_chunks_use_the_new_key_value_rows(dtype, monkeypatch):
    """Fresh chunks (no cached prefix): up to KERNEL_MAX_Q_LEN rows in the kernel from the cache,
    longer ones as SDPA on the new rows themselves (their cache rows are poisoned after the store).
    bf16 chunks where the AMX chunk kernel runs read the cache instead: it is kept out here."""
    monkeypatch.setattr(cpu_attention, "_chunk_kernel", lambda: None)
    long = KERNEL_MAX_Q_LEN + 5
    lens = [(20, 20), (1, 33), (long, long)]
    batch = make_batch([q for q, _ in lens], [n for _, n in lens], 4, 2, 64, dtype=dtype)
    num_rows = sum(q for q, _ in lens)
    key, value = torch.randn(num_rows, 2, 64).to(dtype), torch.randn(num_rows, 2, 64).to(dtype)
    slots = []
    for s, (q_len, seq_len) in enumerate(lens):
        for p in range(seq_len - q_len, seq_len):
            slots.append(int(batch["block_tables"][s, p // 16]) * 16 + p % 16)
    store_kv_cpu(key, value, batch["k_cache"], batch["v_cache"], torch.tensor(slots))
    ref = paged_attention_ref(**batch)
    for cache in (batch["k_cache"], batch["v_cache"]):  # the long chunk must not read its blocks
        cache[batch["block_tables"][2, :-(-long // 16)].long()] = float("nan")
    out = paged_attention_cpu(**batch, key=key, value=value)
    assert not torch.isnan(out).any(), "the long fresh chunk read the cache"
    assert_close(out, ref, batch, {"key": key})


@pytest.mark.parametrize("flags, limits", [
    ({"avx512_bf16", "amx_tile", "amx_bf16"}, (KERNEL_MAX_Q_LEN, AMX_BF16_KERNEL_MAX_Q_LEN, KERNEL_MAX_Q_LEN)),
    ({"avx512_bf16", "amx_int8"}, (KERNEL_MAX_Q_LEN,) * 3),
])
def test_the_kernel_limit_per_dtype(monkeypatch, flags, limits):
    """Only bf16 on a CPU with AMX-BF16 (where SDPA's matmuls run on tiles) hands chunks over 64
    rows to SDPA; fp32 and fp16 keep the kernel up to KERNEL_MAX_Q_LEN."""
    monkeypatch.setattr(cpu_attention, "cpu_flags", lambda: frozenset(flags))
    assert tuple(kernel_max_q_len(t) for t in (torch.float32, torch.bfloat16, torch.float16)) == limits


@needs_kernel
def test_bf16_chunks_over_the_amx_limit_run_as_sdpa(monkeypatch):
    """With AMX-BF16 but no AMX chunk kernel (Linux refusing the tiles), a fresh bf16 chunk of 65
    rows runs as SDPA on the new rows (its cache blocks poisoned) and a 64-row one with a prefix in
    the kernel: on any CPU, the flag faked."""
    monkeypatch.setattr(cpu_attention, "cpu_flags", lambda: frozenset({"amx_bf16"}))
    monkeypatch.setattr(cpu_attention, "_chunk_kernel", lambda: None)
    lens = [(AMX_BF16_KERNEL_MAX_Q_LEN, 90), (AMX_BF16_KERNEL_MAX_Q_LEN + 1, AMX_BF16_KERNEL_MAX_Q_LEN + 1), (1, 40)]
    batch = make_batch([q for q, _ in lens], [n for _, n in lens], 4, 2, 64, dtype=torch.bfloat16)
    q_len = lens[1][0]
    key, value = (batch[c][batch["block_tables"][1, :-(-q_len // 16)].long()].reshape(-1, 2, 64)[:q_len].clone()
                  for c in ("k_cache", "v_cache"))
    ref = paged_attention_ref(**batch)
    for cache in (batch["k_cache"], batch["v_cache"]):  # the fresh chunk must not read its blocks
        cache[batch["block_tables"][1, :-(-q_len // 16)].long()] = float("nan")
    rows = batch["cu_seqlens_q"].tolist()
    new = torch.zeros(rows[-1], 2, 64, dtype=torch.bfloat16)
    new[rows[1]:rows[2]], v_new = key, torch.zeros_like(new)
    v_new[rows[1]:rows[2]] = value
    out = paged_attention_cpu(**batch, key=new, value=v_new)
    assert not torch.isnan(out).any(), "the 65-row fresh chunk read the cache: the kernel ran it"
    assert_close(out, ref, batch, {})


needs_chunk_kernel = pytest.mark.skipif(cpu_attention._chunk_kernel() is None,
                                        reason="no AMX-BF16 here (or Linux refuses the tiles)")


def _count_chunk_calls(monkeypatch) -> list:
    calls, fn = [], cpu_attention._chunk_kernel()
    monkeypatch.setattr(cpu_attention, "_chunk_kernel", lambda: (lambda args: (calls.append(1), fn(args))[1]))
    return calls


@needs_chunk_kernel
@pytest.mark.parametrize("head_dim", [64, 128, 96, 32])  # 96: a last pass of two 16-dim tiles
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("block_size", [16, 8, 32])
def test_long_bf16_chunks_run_on_amx_tiles(head_dim, group, block_size, monkeypatch):
    """bf16 chunks over the row kernel's limit, fresh or after a prefix, their lengths off every
    16-row and 32-key edge, beside decodes and short chunks: the AMX kernel's rows within SDPA's
    tolerance (it rounds P to bf16 as SDPA does), nothing past a sequence's end read."""
    calls = _count_chunk_calls(monkeypatch)
    limit = kernel_max_q_len(torch.bfloat16)
    q_lens = [limit + 1, 1, 100, 5, 2 * limit + 17, limit + 33]
    seq_lens = [limit + 1, 40, 100, 60, 2 * limit + 17 + 45, limit + 33 + 200]
    check(make_batch(q_lens, seq_lens, 2 * group, 2, head_dim, block_size=block_size, seed=group,
                     dtype=torch.bfloat16))
    assert calls == [1]


@needs_chunk_kernel
@pytest.mark.parametrize("window", [1, 16, 37, 100])
def test_long_bf16_chunks_honour_a_sliding_window(window, monkeypatch):
    """Each row sees its own window only, and the blocks before the first row's window are never
    read (poisoned with NaN after the reference ran)."""
    calls = _count_chunk_calls(monkeypatch)
    limit = kernel_max_q_len(torch.bfloat16)
    batch = make_batch([limit + 30, 1, 2 * limit], [limit + 30 + 70, 90, 2 * limit], 8, 2, 64, seed=window,
                       dtype=torch.bfloat16)
    check_windowed(dict(batch, sliding_window=window))
    assert calls == [1]


@needs_chunk_kernel
def test_long_bf16_chunks_with_a_soft_cap_or_sinks_stay_on_sdpa(monkeypatch):
    calls = _count_chunk_calls(monkeypatch)
    limit = kernel_max_q_len(torch.bfloat16)
    batch = make_batch([limit + 3], [limit + 40], 4, 2, 64, dtype=torch.bfloat16)
    check(dict(batch, logits_soft_cap=20.0))
    check(dict(batch, sinks=torch.randn(4)))
    assert calls == []


@needs_chunk_kernel
def test_a_long_chunk_with_a_block_outside_the_cache_is_named():
    limit = kernel_max_q_len(torch.bfloat16)
    batch = make_batch([limit + 3], [limit + 40], 4, 2, 64, dtype=torch.bfloat16)
    batch["block_tables"][0, 2] = batch["k_cache"].shape[0]
    with pytest.raises(ValueError, match="block id outside the cache"):
        paged_attention_cpu(**batch)


def special_values(dtype, n, gen):
    """n values of dtype: its extremes (smallest subnormal, smallest normal, max, +-inf, NaN, 0)
    first, then random ones across its whole exponent range, subnormals included."""
    info = torch.finfo(dtype)
    subnormal = info.tiny * info.eps  # the smallest: 2^-133 (bf16), 2^-24 (fp16)
    fixed = torch.tensor([subnormal, 3 * subnormal, info.tiny, info.tiny - subnormal, info.max, -info.max,
                          math.inf, -math.inf, math.nan, 1.0, -1.0, 0.0])
    exponents = torch.randint(int(math.log2(subnormal)), int(math.log2(info.max)),
                              (n - len(fixed),), generator=gen)
    rand = torch.randn(n - len(fixed), generator=gen) * torch.pow(2.0, exponents.double()).float()
    return torch.cat([fixed, rand]).to(dtype)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 40])  # 40: the scalar (not CHUNK-wide) loads
def test_half_types_convert_exactly(dtype, head_dim):
    """A zero query scores every key alike, so a sequence of one key returns its value row and
    one of two keys their mean (v0 + v1) * 0.5, both computed exactly in fp32: the output's
    bits must be the reference's, through subnormals, ties (round to nearest even), inf and NaN."""
    gen = torch.Generator().manual_seed(head_dim)
    num_seqs = 64
    values = special_values(dtype, 2 * num_seqs * head_dim, gen).view(num_seqs, 2, head_dim)
    values[1::2] = values[1::2].abs()  # two-key sequences: same signs, so no inf - inf
    v_cache = torch.zeros(num_seqs, 16, 1, head_dim, dtype=dtype)
    v_cache[:, :2, 0] = values
    seq_lens = torch.tensor([1, 2] * (num_seqs // 2), dtype=torch.int32)
    batch = dict(query=torch.zeros(num_seqs, 1, head_dim, dtype=dtype),
                 k_cache=torch.randn(num_seqs, 16, 1, head_dim, generator=gen).to(dtype), v_cache=v_cache,
                 block_tables=torch.arange(num_seqs, dtype=torch.int32)[:, None], seq_lens=seq_lens,
                 cu_seqlens_q=torch.arange(num_seqs + 1, dtype=torch.int32), max_seqlen_q=1,
                 softmax_scale=0.125)
    v = values.float()
    expect = torch.where(seq_lens[:, None] == 1, v[:, 0], (v[:, 0] + v[:, 1]) * 0.5)
    expect = (expect + 0.0).to(dtype)  # -0 -> +0: the kernel's sums start from +0 (equal values)
    out = paged_attention_cpu(**batch)
    assert torch.equal(out[:, 0].view(torch.int16), expect.view(torch.int16))


@pytest.fixture(scope="module")
def portable_kernel(tmp_path_factory):
    """The kernel built without AVX-512: the generic vector code (and conversions) other CPUs run."""
    if platform.machine() not in ("x86_64", "AMD64") or shutil.which("cc") is None:
        pytest.skip("an x86 C compiler is needed to build without AVX-512")
    source = Path(cpu_attention.__file__).with_name("cpu_paged_attention.c")
    target = tmp_path_factory.mktemp("portable") / "cpu_paged_attention_portable.so"
    error = cpu_build._compile("cc", source, target, ["-O2", "-march=native", "-mno-avx512f", "-fopenmp",
                                                      "-shared", "-fPIC"])
    assert error is None, error
    fn = ctypes.CDLL(str(target)).rayllm_paged_attention
    fn.argtypes, fn.restype = [ctypes.POINTER(cpu_attention._Args)], ctypes.c_int
    return fn


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_build_without_avx512_agrees(portable_kernel, monkeypatch, dtype):
    """Decodes and chunks with a prefix, and the half types' exact conversions, through the
    generic code: the AVX-512 build widens half types and broadcasts with instructions of its own."""
    monkeypatch.setattr(cpu_attention, "_kernel", lambda: portable_kernel)
    check(make_batch([1] * len(DECODE_LENS), DECODE_LENS, 4, 2, 64, seed=3, dtype=dtype))
    check(make_batch([5, 16, 1], [40, 16, 200], 8, 2, 128, seed=4, dtype=dtype))
    if dtype != torch.float32:
        test_half_types_convert_exactly(dtype, 64)


# Decodes, short chunks with a prefix (the kernel), a long one (SDPA), around the windows.
WINDOW_Q_LENS = [1, 1, 1, 1, 5, 20, KERNEL_MAX_Q_LEN + 7]
WINDOW_SEQ_LENS = [3, 17, 40, 300, 50, 20, KERNEL_MAX_Q_LEN + 90]


@needs_kernel
@pytest.mark.parametrize("window, block_size", [(1, 16), (5, 8), (5, 16), (16, 32), (37, 24),
                                                (37, 16), (4096, 16)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_sliding_window(window, block_size, dtype):
    """Windows shorter than a block and spanning several; 8 and 24 take the row-by-row path."""
    batch = make_batch(WINDOW_Q_LENS, WINDOW_SEQ_LENS, 4, 2, 64, block_size=block_size, seed=window,
                       dtype=dtype)
    check_windowed(dict(batch, sliding_window=window))


@needs_kernel
@pytest.mark.parametrize("head_dim", [64, 40])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 4])
def test_soft_cap_and_sinks(group, head_dim, dtype):
    gen = torch.Generator().manual_seed(group)
    batch = make_batch(WINDOW_Q_LENS, WINDOW_SEQ_LENS, 2 * group, 2, head_dim, seed=group, dtype=dtype)
    sinks = 3 * torch.randn(2 * group, generator=gen)
    check(dict(batch, logits_soft_cap=1.5))
    check(dict(batch, sinks=sinks))
    check_windowed(dict(batch, sliding_window=21, logits_soft_cap=30.0, sinks=sinks))


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
def test_fresh_chunks_with_a_window_use_the_new_rows(dtype):
    batch = make_batch([45, 1], [45, 33], 4, 2, 64, dtype=dtype)
    key, value = torch.randn(46, 2, 64).to(dtype), torch.randn(46, 2, 64).to(dtype)
    slots = [int(batch["block_tables"][0, p // 16]) * 16 + p % 16 for p in range(45)]
    slots.append(int(batch["block_tables"][1, 2]) * 16)  # position 32
    store_kv_cpu(key, value, batch["k_cache"], batch["v_cache"], torch.tensor(slots))
    sinks = torch.randn(4)
    check(dict(batch, sliding_window=9), key=key, value=value)
    check(dict(batch, sliding_window=9, logits_soft_cap=2.0, sinks=sinks), key=key, value=value)


def test_torch_fallback_honours_the_score_options(fresh_build, monkeypatch):
    monkeypatch.setenv(cpu_build.DISABLE_ENV, "1")
    assert not kernel_available()
    batch = make_batch(WINDOW_Q_LENS, WINDOW_SEQ_LENS, 4, 2, 64, poison=1e4)
    check(dict(batch, sliding_window=11, logits_soft_cap=5.0, sinks=torch.randn(4)))


@needs_kernel
@pytest.mark.parametrize("extra, message", [
    (dict(sliding_window=0), "sliding_window must be None or a python int >= 1"),
    (dict(logits_soft_cap=float("nan")), "logits_soft_cap must be finite and > 0"),
    (dict(sinks=torch.zeros(2)), r"sinks has shape \(2,\); expected \[num_heads\] = \[4\]"),
])
def test_bad_score_options_are_refused(extra, message):
    with pytest.raises(ValueError, match=message):
        paged_attention_cpu(**make_batch([1], [20], 4, 2, 64), **extra)


@needs_kernel
def test_block_ids_past_30000():
    batch = make_batch([1, 1, 4], [40, 70, 33], 4, 1, 64, num_blocks=30100, first_block=30000)
    assert int(batch["block_tables"][:, :2].min()) >= 30000
    check(batch)


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_query_and_host_lengths(dtype):
    batch = make_batch([1, 6, 1], [20, 6, 64], 4, 2, 64, dtype=dtype)
    q = batch["query"]
    qkv = torch.randn(q.shape[0], 8 * 64).to(dtype)  # query as a view into a fused qkv output
    qkv[:, :256] = q.reshape(q.shape[0], -1)
    batch["query"] = qkv[:, :256].view(q.shape[0], 4, 64)
    check(batch, seq_lens_cpu=[20, 6, 64], query_lens_cpu=[1, 6, 1])


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
def test_thread_counts_agree(threads):
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        check(make_batch([1] * 9 + [7], [5, 90, 17, 33, 2, 64, 65, 128, 1, 40], 8, 2, 64))
    finally:
        torch.set_num_threads(prev)


@needs_kernel
@pytest.mark.parametrize("mutate, message", [
    (lambda b: b["block_tables"].__setitem__((0, 0), 10**6), "block id outside the cache"),
    (lambda b: b["seq_lens"].__setitem__(0, 10**4), "beyond its block_tables row"),
    (lambda b: b["cu_seqlens_q"].__setitem__(2, 1), "cu_seqlens_q"),
])
def test_bad_metadata_is_refused(mutate, message):
    batch = make_batch([1, 1], [20, 40], 4, 2, 64)
    mutate(batch)
    with pytest.raises(ValueError, match=message):
        paged_attention_cpu(**batch)


def test_store_kv_cpu_matches_reference():
    key, value = torch.randn(5, 2, 64), torch.randn(5, 2, 64)
    caches = [torch.zeros(4, 16, 2, 64) for _ in range(4)]
    slots = torch.tensor([3, -1, 17, 63, 0])
    store_kv_cpu(key, value, caches[0], caches[1], slots)
    store_kv_ref(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    with pytest.raises(ValueError, match="slot 64"):
        store_kv_cpu(key, value, caches[0], caches[1], torch.tensor([0, 1, 2, 64, 3]))


@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    """An empty kernel cache directory and no library loaded yet; restored afterwards."""
    monkeypatch.setenv(cpu_build.CACHE_ENV, str(tmp_path))
    cpu_build.load_kernel_library.cache_clear()
    yield tmp_path
    cpu_build.load_kernel_library.cache_clear()


def test_disabled_kernel_falls_back_to_torch(fresh_build, monkeypatch):
    monkeypatch.setenv(cpu_build.DISABLE_ENV, "1")
    assert not kernel_available()
    check(make_batch([1, 1, 5], [17, 40, 30], 4, 2, 64, poison=1e4))
    assert not list(fresh_build.iterdir())  # nothing was built


def test_failed_build_warns_once_and_falls_back(fresh_build, monkeypatch):
    monkeypatch.setenv("CC", str(fresh_build / "no-such-compiler"))
    with pytest.warns(RuntimeWarning, match="torch path"):
        assert not kernel_available()
    check(make_batch([1, 3], [17, 40], 4, 2, 64, poison=1e4))  # the torch path answers


@needs_kernel
def test_build_is_cached_by_source_hash(fresh_build):
    assert kernel_available()
    built = [p for p in fresh_build.iterdir()]
    assert len(built) == 1 and built[0].suffix == ".so"  # the temp file was renamed, none left
    mtime = built[0].stat().st_mtime_ns
    cpu_build.load_kernel_library.cache_clear()
    assert kernel_available() and built[0].stat().st_mtime_ns == mtime  # reused, not rebuilt
