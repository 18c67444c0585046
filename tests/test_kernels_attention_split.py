"""Split-KV paged attention (kernels/triton_attention_split.py) against the reference.

Under the Triton interpreter on CPU, natively on a GPU. Each case forces the
segment count (num_splits=...) or checks which path the heuristic picks; the
plain kernel's own cases live in test_kernels_attention.py.
"""

import pytest
import torch

from tests.triton_device import DEVICE  # before kernels: sets the interpreter up

import kernels.triton_attention as ta  # noqa: E402
import kernels.triton_attention_split as split_kv  # noqa: E402
from kernels import paged_attention, paged_attention_ref  # noqa: E402
from tests.test_kernels_attention import (CASES, DTYPES, TOL, check_against_ref, make_batch,  # noqa: E402
                                          score_batch)


@pytest.fixture
def reduce_calls(monkeypatch):
    """Counts launches of the reduce pass, i.e. of split-KV."""
    calls = []
    real = split_kv.reduce_splits

    def spy(out, part_o, part_m, part_l):
        calls.append(part_o.shape[2])  # num_splits
        real(out, part_o, part_m, part_l)
    monkeypatch.setattr(split_kv, "reduce_splits", spy)
    return calls


def check_split(batch, dtype, num_splits, reduce_calls):
    check_against_ref(batch, dtype, backends=("triton",), num_splits=num_splits)
    assert reduce_calls[-1:] == [num_splits]


# Every plain-kernel case (mixed prefill + decode, chunks over a cached prefix,
# gather addressing, padded head_dims) also split, 3 segments (a non-power of two).
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_split_cases(case, reduce_calls):
    dtype = DTYPES[list(CASES).index(case) % 3]
    q_lens, seq_lens, heads, kv_heads, head_dim, block_size = CASES[case]
    batch = make_batch(q_lens, seq_lens, heads, kv_heads, head_dim, block_size, dtype)
    check_split(batch, dtype, 3, reduce_calls)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_segment_boundaries(dtype, reduce_calls):
    """Contexts ending on, one past and one short of a segment boundary, and short
    sequences whose last segments are empty, next to a prefill chunk."""
    num_splits, head_dim, block_size = 4, 64, 16
    tile_n = ta._launch_config(1, 2, head_dim, block_size, dtype)["TILE_N"]
    assert tile_n == 16
    decode_lens = [1, 17, 33, 95, 96, 97, 128, 129]
    seg = {n: split_kv.segment_bounds(n, num_splits, tile_n) for n in decode_lens}
    assert seg[128][-1] == (96, 128) and seg[96][2] == (64, 96)  # ends on a boundary
    assert seg[97][-1] == (96, 97) and seg[129][-1] == (144, 129)  # one past; empty last
    assert seg[1][1:] == [(16, 1), (32, 1), (48, 1)]  # all but the first segment empty
    assert seg[95][-1] == (96, 95)  # one short: the last segment is empty
    q_lens = [1] * len(decode_lens) + [40]
    batch = make_batch(q_lens, decode_lens + [70], 4, 2, head_dim, block_size, dtype)
    check_split(batch, dtype, num_splits, reduce_calls)


@pytest.mark.parametrize("case", ["decode_window_spans_blocks", "chunk_with_prefix_window",
                                  "mixed_window_gather_bs8", "all_three"])
def test_split_score_options(case, reduce_calls):
    """Windows (segments divide only the keys from the window's first tile on), the soft
    cap, and sinks (folded into segment 0 alone) with a forced split."""
    check_split(score_batch(case, seed=1), torch.float32, 3, reduce_calls)


def test_split_window_skips_to_the_window(reduce_calls):
    """Long decodes behind a short window: the segments of [kv_start, kv_end) all lie in the
    window, and the sink still counts once."""
    assert split_kv.segment_bounds(300, 3, 16, kv_start=272) == [(272, 288), (288, 300), (304, 300)]
    batch = make_batch([1, 1, 4], [300, 77, 38], 4, 2, 32, 16, torch.float32, seed=2)
    batch.update(sliding_window=29, logits_soft_cap=None, sinks=torch.randn(4).to(DEVICE))
    check_split(batch, torch.float32, 3, reduce_calls)


def test_window_bounds_the_split_heuristic(reduce_calls):
    """The heuristic's context bound is the window, not the table: a long table behind a
    short window does not split."""
    batch = make_batch([1, 1], [4000, 3000], 4, 1, 16, 64, torch.bfloat16)
    batch.update(sliding_window=64, logits_soft_cap=None, sinks=None)
    check_against_ref(batch, torch.bfloat16, backends=("triton",))
    assert reduce_calls == []


@pytest.mark.parametrize("group", [1, 2, 4, 8, 16])
def test_split_gqa_groups(group, reduce_calls):
    dtype = DTYPES[group % 3]
    kv_heads = 2 if group <= 4 else 1
    batch = make_batch([1, 1, 6], [300, 77, 38], kv_heads * group, kv_heads, 32, 16, dtype,
                       seed=group)
    check_split(batch, dtype, 5, reduce_calls)


def test_long_context_16k_takes_split_by_default(reduce_calls):
    """16k-token decodes: the heuristic splits, and the merged result is right."""
    dtype = torch.bfloat16
    batch = make_batch([1, 1], [16384, 2000], 4, 1, 16, 64, dtype)
    expected = split_kv.choose_num_splits(2, 1, 1, batch["block_tables"].shape[1] * 64,
                                          split_kv.num_sms(batch["query"].device))
    assert expected > 1
    check_against_ref(batch, dtype, backends=("triton",))
    assert reduce_calls == [expected]


def test_heuristic_picks_plain_kernel_for_prefill_and_full_grids(reduce_calls):
    dtype = torch.float16
    prefill = make_batch([1, 20], [300, 20], 4, 2, 32, 16, dtype)
    check_against_ref(prefill, dtype, backends=("triton",))
    many = make_batch([1] * 8, [100] * 8, 4, 2, 32, 16, dtype)  # 16 programs >= 2 x 4 SMs
    check_against_ref(many, dtype, backends=("triton",))
    assert reduce_calls == []


def test_choose_num_splits():
    choose = split_kv.choose_num_splits
    # 4 x 8192 on an H100: 32 programs for 132 SMs -> enough segments for two waves.
    assert choose(4, 8, 1, 8192, 132) == 9
    assert choose(1, 1, 1, 1 << 20, 132) == split_kv.MAX_SPLITS
    assert choose(256, 8, 1, 8192, 132) == 1  # grid already full
    assert choose(4, 8, 16, 8192, 132) == 1  # a prefill chunk in the launch
    assert choose(4, 8, 1, 512, 132) == 2  # a short context bound caps the segments
    assert choose(4, 8, 1, 100, 132) == 1


def test_module_knob_forces_split(monkeypatch, reduce_calls):
    monkeypatch.setattr(ta, "NUM_SPLITS", 2)
    batch = make_batch([1, 3], [40, 50], 4, 4, 64, 16, torch.float32)
    check_against_ref(batch, torch.float32, backends=("triton",))
    assert reduce_calls == [2]
    check_against_ref(batch, torch.float32, backends=("triton",), num_splits=1)
    assert reduce_calls == [2]  # the argument wins over the knob


def test_multi_block_tiles_with_split(monkeypatch, reduce_calls):
    """KV_TILE larger than the block (the bench's sweep): per-key gather, split."""
    monkeypatch.setattr(ta, "KV_TILE", 64)
    batch = make_batch([1, 1, 5], [200, 63, 70], 8, 2, 64, 16, torch.float16)
    check_split(batch, torch.float16, 3, reduce_calls)
    monkeypatch.setattr(ta, "KV_TILE", 24)
    with pytest.raises(ValueError, match="KV_TILE"):
        paged_attention(**batch)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "4", split_kv.MAX_FORCED_SPLITS + 1])
def test_bad_num_splits(bad):
    batch = make_batch([1], [20], 2, 2, 64, 16, torch.float32)
    with pytest.raises(ValueError, match="num_splits"):
        paged_attention(**batch, num_splits=bad)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_split_in_cuda_graph_replays_new_lengths():
    """Captured once, replayed with other lengths and tables: the split count is fixed
    by host values, segment lengths follow seq_lens on the device; no memory leaks."""
    dtype = torch.bfloat16
    static = make_batch([1] * 4, [8192] * 4, 32, 8, 128, 16, dtype, seed=1)
    assert ta.split_kv.choose_num_splits(4, 8, 1, static["block_tables"].shape[1] * 16,
                                         split_kv.num_sms(static["query"].device)) > 1
    tables = static["block_tables"].clone()
    variants = [([8192, 100, 4000, 1], [0, 1, 2, 3]), ([17, 8000, 8192, 2500], [3, 0, 1, 2])]
    out = torch.empty_like(static["query"])
    paged_attention(**static, out=out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_attention(**static, out=out)
    base = torch.cuda.memory_allocated()
    for lens, rows in variants + variants[:1]:
        static["seq_lens"].copy_(torch.tensor(lens, dtype=torch.int32))
        static["block_tables"].copy_(tables[rows])
        graph.replay()
        ref = paged_attention_ref(**static)
        torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])
    del ref
    for _ in range(3):
        paged_attention(**static)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= base


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("num_splits", [1, None, 16])
@pytest.mark.parametrize("group", [1, 4, 8, 16])
def test_gpu_long_context(num_splits, group):
    dtype = torch.bfloat16
    lens = [16384, 9000, 16383, 4097]
    kv_heads = 4 if group < 16 else 1
    batch = make_batch([1] * 4, lens, kv_heads * group, kv_heads, 128, 16, dtype, seed=group)
    check_against_ref(batch, dtype, backends=("triton",), num_splits=num_splits)
