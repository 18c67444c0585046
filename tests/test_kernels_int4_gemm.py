"""kernels/triton_int4_gemm.py against a dense dequantization written from the layout's definition:
natively on a GPU, under the Triton interpreter on CPU (tiny shapes)."""
import pytest
import torch

from tests.triton_device import DEVICE  # before kernels: sets the interpreter up

from kernels.triton_int4_gemm import int4_gemm, int4_gemm_torch, unpack_int4_rows  # noqa: E402

SMALL = (16, 16, 32)


def make_case(m, k, n, group_size, shuffled=False, dtype=torch.float32, seed=0):
    """Random codes packed by hand (row k in nibble k % 8), scales, zeros 0..16 and g_idx; and the
    dense W [N, K] they stand for, from W[n, k] = (q - z[g_idx[k], n]) * s[g_idx[k], n]."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (k, n), generator=g, dtype=torch.int32)
    packed = torch.zeros(k // 8, n, dtype=torch.int32)
    for i in range(8):
        packed |= q[i::8] << (4 * i)  # int32 wraps: nibble 7 sets the sign bit, as checkpoints do
    groups = -(-k // group_size)
    scales = (torch.rand(groups, n, generator=g) * 0.1 + 0.01).half()
    zeros = torch.randint(0, 17, (groups, n), generator=g, dtype=torch.uint8)
    g_idx = torch.arange(k, dtype=torch.int32) // group_size
    if shuffled:  # act-order: the rows of a group scattered over K
        g_idx = g_idx[torch.randperm(k, generator=g)]
    dense = ((q - zeros[g_idx.long()].int()).float() * scales[g_idx.long()].float()).T
    x = torch.randn(m, k, generator=g)
    to = dict(device=DEVICE)
    return (x.to(dtype=dtype, **to), packed.to(**to), scales.to(**to), zeros.to(**to), g_idx.to(**to)), dense.to(**to)


def test_unpack_inverts_the_packing_including_the_sign_bit():
    (_, packed, *_), _ = make_case(1, 16, 5, 8)
    codes = unpack_int4_rows(packed.cpu())
    assert codes.min() >= 0 and codes.max() <= 15 and (packed < 0).any()
    repacked = torch.zeros_like(packed.cpu())
    for i in range(8):
        repacked |= codes[i::8] << (4 * i)
    assert torch.equal(repacked, packed.cpu())


@pytest.mark.parametrize("m, k, n, group_size, shuffled", [
    (1, 64, 48, 32, False),     # one row: decode
    (5, 96, 40, 32, False),     # K and N end on partial tiles
    (17, 64, 24, 64, True),     # act-order g_idx, M over one tile
    (3, 40, 33, 8, False),      # odd N, K a multiple of 8 but not of the tile
    (2, 128, 16, 128, True),    # one group (per channel)
])
def test_triton_and_torch_equal_the_dense_weight(m, k, n, group_size, shuffled):
    args, dense = make_case(m, k, n, group_size, shuffled)
    expected = args[0] @ dense.T
    torch.testing.assert_close(int4_gemm(*args, block=SMALL), expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(int4_gemm_torch(*args, tile_n=16), expected, atol=1e-4, rtol=1e-4)


def test_half_activations_and_the_default_tiles():
    args, dense = make_case(6, 64, 40, 32, dtype=torch.bfloat16)
    expected = args[0].float() @ dense.T
    out = int4_gemm(*args)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, atol=5e-2, rtol=2e-2)
    torch.testing.assert_close(int4_gemm_torch(*args).float(), expected, atol=5e-2, rtol=2e-2)


def test_empty_batch_and_bad_arguments_are_named():
    (x, packed, scales, zeros, g_idx), _ = make_case(2, 32, 16, 32)
    assert int4_gemm(x[:0], packed, scales, zeros, g_idx).shape == (0, 16)
    with pytest.raises(ValueError, match="qweight has 4 packed rows"):
        int4_gemm(x[:, :24], packed, scales, zeros, g_idx[:24])
    with pytest.raises(ValueError, match="zeros must be a 2-D tensor of torch.uint8"):
        int4_gemm(x, packed, scales, zeros.int(), g_idx)
    with pytest.raises(ValueError, match="g_idx has 31 entries"):
        int4_gemm_torch(x, packed, scales, zeros, g_idx[:31])
    with pytest.raises(ValueError, match=r"scales \(2, 16\) and zeros \(1, 16\)"):
        int4_gemm(x, packed, torch.cat([scales, scales]), zeros, g_idx)
