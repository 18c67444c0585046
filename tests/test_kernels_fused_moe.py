"""kernels/triton_fused_moe.py against the dense pure-torch oracle: natively on a GPU, under the
Triton interpreter on CPU (tiny shapes: the interpreter runs every program in Python)."""
import pytest
import torch

from tests.triton_device import DEVICE  # before kernels: sets the interpreter up

from kernels.triton_fused_moe import choose_config, fused_moe, fused_moe_ref, moe_align_block_size  # noqa: E402

SMALL_TILES = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2)


def make_case(num_tokens, num_experts, top_k, hidden=32, inter=24, dtype=torch.float32, idle=(), seed=0):
    """Weights, hidden states and a softmax top-k routing; experts in `idle` get no token."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=g)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden ** 0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=g) / inter ** 0.5
    logits = torch.randn(num_tokens, num_experts, generator=g)
    logits[:, list(idle)] = float("-inf")
    weights, ids = logits.softmax(-1).topk(top_k, dim=-1)
    to = dict(device=DEVICE, dtype=dtype)
    return x.to(**to), w13.to(**to), w2.to(**to), weights.to(DEVICE), ids.to(DEVICE)


@pytest.mark.parametrize("num_tokens, num_experts, top_k, idle", [
    (1, 4, 2, ()),           # a batch of 1: one tile per expert it reaches, all others skipped
    (9, 6, 2, (1, 5)),       # experts that get no token
    (40, 4, 1, ()),          # top-1, several tiles for one expert
    (21, 8, 3, (0,)),
])
def test_matches_dense_reference(num_tokens, num_experts, top_k, idle):
    case = make_case(num_tokens, num_experts, top_k, idle=idle)
    ids = case[4]
    assert not any((ids == e).any() for e in idle)
    out = fused_moe(*case, config=SMALL_TILES)
    torch.testing.assert_close(out, fused_moe_ref(*case), atol=1e-4, rtol=1e-4)


def test_dims_that_are_not_a_multiple_of_the_tiles_and_the_default_config():
    case = make_case(5, 3, 2, hidden=40, inter=20)  # K and N loops end on partial tiles
    torch.testing.assert_close(fused_moe(*case, config=SMALL_TILES), fused_moe_ref(*case), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(fused_moe(*case), fused_moe_ref(*case), atol=1e-4, rtol=1e-4)


def test_half_precision_stays_close():
    case = make_case(12, 4, 2, dtype=torch.bfloat16)
    ref = fused_moe_ref(*[t.float() if t.is_floating_point() else t for t in case])
    out = fused_moe(*case, config=SMALL_TILES)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)


def test_align_block_size_groups_rows_by_expert_in_whole_tiles():
    ids = torch.tensor([[2, 0], [2, 3], [0, 2]], device=DEVICE)  # expert 1 idle
    sorted_ids, expert_ids, num_post_pad = moe_align_block_size(ids, 4, block_m=4)
    used = int(num_post_pad)
    assert used == 3 * 4  # experts 0, 2, 3 each fill one padded tile
    tiles = sorted_ids[:used].view(-1, 4).tolist()
    sentinel = ids.numel()
    assert tiles == [[1, 4, sentinel, sentinel], [0, 2, 5, sentinel], [3, sentinel, sentinel, sentinel]]
    assert expert_ids[: used // 4].tolist() == [0, 2, 3]
    assert sorted_ids.numel() % 4 == 0 and sorted_ids.numel() >= used


def test_config_grows_tiles_with_rows_per_expert():
    small = choose_config(1, 8, 128, torch.bfloat16)
    large = choose_config(8192, 8, 128, torch.bfloat16)
    assert small["BLOCK_M"] == 16 and large["BLOCK_M"] > small["BLOCK_M"]
    assert choose_config(1, 8, 128, torch.float32)["BLOCK_K"] == small["BLOCK_K"] // 2


def test_bad_arguments_are_named():
    x, w13, w2, weights, ids = make_case(3, 4, 2)
    with pytest.raises(ValueError, match="w2"):
        fused_moe(x, w13, w2[:, :, :-1], weights, ids)
    with pytest.raises(ValueError, match="topk_weights"):
        fused_moe(x, w13, w2, weights[:, :1], ids)
    with pytest.raises(ValueError, match="dtype"):
        fused_moe(x.double(), w13, w2, weights, ids)
