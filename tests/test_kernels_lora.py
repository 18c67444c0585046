"""kernels/triton_lora.py (shrink, expand) against the float64 oracles of kernels/reference.py:
natively on a GPU, under the Triton interpreter on CPU (tiny shapes: it runs every program in Python).
The slots are laid out as engine/layers/lora.py lays them: ranks below the max zero-padded, B
block-diagonal over the fused parts."""
import pytest
import torch

from tests.triton_device import DEVICE  # before kernels: sets the interpreter up

from kernels.lora_mapping import sort_tokens_by_slot  # noqa: E402
from kernels.reference import lora_expand_ref, lora_shrink_ref  # noqa: E402
from kernels.triton_lora import add_lora, choose_config, lora_expand, lora_shrink  # noqa: E402

HIDDEN = 40  # not a multiple of any BLOCK_K: the K loop ends on a partial tile
# K split 4 ways in 16-wide steps: splits cover [0, 16), [16, 32), [32, 40) and an empty range.
SPLIT_TILES = dict(BLOCK_M=16, BLOCK_K=16, SPLIT_K=4, EXPAND_BLOCK_N=16)


def make_slots(part_sizes: list[int], ranks: list[int], max_rank: int, dtype=torch.float32, seed=0):
    """lora_a [L, P*R, K], lora_b [L, out, P*R] (slot s an adapter of rank ranks[s]) and part_offsets."""
    gen = torch.Generator().manual_seed(seed)
    num_parts, out = len(part_sizes), sum(part_sizes)
    offsets = [sum(part_sizes[:p]) for p in range(num_parts + 1)]
    a = torch.zeros(len(ranks), num_parts * max_rank, HIDDEN)
    b = torch.zeros(len(ranks), out, num_parts * max_rank)
    for s, r in enumerate(ranks):
        for p in range(num_parts):
            cols = slice(p * max_rank, p * max_rank + r)
            a[s, cols] = torch.randn(r, HIDDEN, generator=gen) / HIDDEN ** 0.5
            b[s, offsets[p]:offsets[p + 1], cols] = torch.randn(part_sizes[p], r, generator=gen)
    to = dict(device=DEVICE, dtype=dtype)
    b = b.transpose(1, 2).contiguous().transpose(1, 2)  # stored as B^T, as engine/layers/lora.py does
    return a.to(**to), b.to(**to), torch.tensor(offsets, dtype=torch.int32, device=DEVICE)


def mapping(token_slots: list[int], max_loras: int):
    sorted_ids, starts = sort_tokens_by_slot(token_slots, max_loras)
    as_tensor = dict(dtype=torch.int32, device=DEVICE)
    return torch.tensor(sorted_ids, **as_tensor), torch.tensor(starts, **as_tensor)


# (token_slots, fused part sizes, each slot's rank, max rank): base rows (-1) among adapter rows,
# a slot no row uses, ranks below the max, one to three parts of unequal widths.
CASES = {
    "qkv, two adapters and base rows": ([1, -1, 0, 1, -1, 0, 0], [24, 8, 8], [8, 3], 8),
    "one part, an idle slot": ([2, 0, 0, -1, 2], [20], [4, 8, 2, 8], 8),
    "gate_up, every row one adapter": ([1] * 6, [16, 16], [5, 16], 16),
    "only base rows": ([-1, -1, -1], [24, 8, 8], [8, 8], 8),
}


@pytest.mark.parametrize("name", list(CASES))
def test_shrink_and_expand_equal_the_reference(name):
    token_slots, parts, ranks, max_rank = CASES[name]
    a, b, offsets = make_slots(parts, ranks, max_rank)
    x = torch.randn(len(token_slots), HIDDEN, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    sorted_ids, starts = mapping(token_slots, len(ranks))
    buf = lora_shrink(x, a, sorted_ids, starts, SPLIT_TILES)
    ref_buf = lora_shrink_ref(x, a, token_slots)
    rows = [t for t, s in enumerate(token_slots) if s >= 0]
    torch.testing.assert_close(buf.sum(0)[rows], ref_buf[rows], atol=1e-5, rtol=1e-5)

    y0 = torch.randn(len(token_slots), sum(parts), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    y, ref = y0.clone(), y0.clone()
    b_nan = b.clone()  # the off-diagonal blocks are never read: NaN there must not show
    for p in range(len(parts)):
        block = b_nan[:, offsets[p]:offsets[p + 1]]
        block[:, :, :p * max_rank] = float("nan")
        block[:, :, (p + 1) * max_rank:] = float("nan")
    lora_expand(buf, b_nan, y, sorted_ids, starts, offsets, SPLIT_TILES)
    lora_expand_ref(ref_buf, b, ref, token_slots)
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)
    base = [t for t, s in enumerate(token_slots) if s < 0]
    assert torch.equal(y[base], y0[base])
    if rows:
        assert not torch.allclose(y[rows], y0[rows]), "the delta changed nothing"


def test_decode_and_prefill_configs_in_half_precision():
    """add_lora with the default tiles: a decode-sized step (16-row tiles) and a larger one (64-row
    tiles, two row tiles for a slot), bf16 weights and activations."""
    a, b, offsets = make_slots([24, 8, 8], [8, 4], 8, dtype=torch.bfloat16)
    assert choose_config(5, HIDDEN, torch.bfloat16)["BLOCK_M"] == 16
    assert choose_config(70, HIDDEN, torch.bfloat16)["BLOCK_M"] == 64
    for n in (5, 70):
        token_slots = [(t % 3) - 1 for t in range(n)]  # base, slot 0, slot 1, ...
        x = torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(n)).to(DEVICE, torch.bfloat16)
        y = torch.zeros(n, 40, dtype=torch.bfloat16, device=DEVICE)
        add_lora(y, x, a, b, *mapping(token_slots, 2), offsets)
        ref = torch.zeros(n, 40, dtype=torch.float32, device=DEVICE)
        lora_expand_ref(lora_shrink_ref(x, a, token_slots), b, ref, token_slots)
        torch.testing.assert_close(y.float(), ref, atol=3e-2, rtol=3e-2)


def test_config_splits_k_for_decode_only():
    assert choose_config(8, 4096, torch.bfloat16)["SPLIT_K"] == 8
    assert choose_config(8192, 4096, torch.bfloat16)["SPLIT_K"] == 1
    assert choose_config(8, 4096, torch.float32)["BLOCK_K"] == choose_config(8, 4096, torch.bfloat16)["BLOCK_K"] // 2


def test_sort_tokens_by_slot_groups_rows_and_puts_base_rows_last():
    assert sort_tokens_by_slot([1, -1, 0, 1, 0], 2) == ([2, 4, 0, 3, 1], [0, 2, 4])
    assert sort_tokens_by_slot([-1, -1], 3) == ([0, 1], [0, 0, 0, 0])
    with pytest.raises(ValueError, match=r"token_slots\[1\]=2 is out of range for max_loras=2"):
        sort_tokens_by_slot([0, 2], 2)


def test_bad_arguments_are_named():
    a, b, offsets = make_slots([24, 8, 8], [8], 8)
    x = torch.randn(3, HIDDEN, device=DEVICE)
    sorted_ids, starts = mapping([0, -1, 0], 1)
    with pytest.raises(ValueError, match="lora_a dtype"):
        lora_shrink(x.half(), a, sorted_ids, starts)
    with pytest.raises(ValueError, match="lora_a"):
        lora_shrink(x[:, :-1], a, sorted_ids, starts)
    with pytest.raises(ValueError, match="slot_starts must be contiguous with 2 entries"):
        lora_shrink(x, a, sorted_ids, starts[:1])
    with pytest.raises(ValueError, match="sorted_token_ids"):
        lora_shrink(x, a, sorted_ids.long(), starts)
    buf = lora_shrink(x, a, sorted_ids, starts)
    y = torch.zeros(3, 40, device=DEVICE)
    with pytest.raises(ValueError, match="y dtype"):
        lora_expand(buf, b, y.half(), sorted_ids, starts, offsets)
    with pytest.raises(ValueError, match="not a multiple of 5 parts"):
        lora_expand(buf, b, y, sorted_ids, starts, torch.zeros(6, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="buf must be"):
        lora_expand(buf[:, :2], b, y, sorted_ids, starts, offsets)
