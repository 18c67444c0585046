"""The Triton block-FP8 GEMM against its pure-torch reference: odd M, N, K (edge tiles and a short
last K group masked), decode and prefill tile sizes, per-token-group activation quantization."""
import math

import pytest
import torch

from tests.triton_device import DEVICE  # before kernels: sets the interpreter up

from kernels.triton_fp8_gemm import (FP8_DTYPE, dequantize_block_fp8, fp8_block_gemm,  # noqa: E402
                                     fp8_block_gemm_ref, fp8_block_linear, per_token_group_quant_fp8)


def make_weight(n, k, block, seed=0):
    """A random [n, k] weight quantized with random positive block scales."""
    g = torch.Generator().manual_seed(seed)
    bn, bk = block
    scale = torch.rand(math.ceil(n / bn), math.ceil(k / bk), generator=g) * 0.02 + 0.001
    w = torch.randn(n, k, generator=g)
    full = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return (w / full).clamp(-448, 448).to(FP8_DTYPE).to(DEVICE), scale.to(DEVICE)


@pytest.mark.parametrize("m, n, k, block", [
    (1, 64, 64, (16, 32)),      # decode, whole blocks
    (5, 37, 70, (16, 32)),      # odd everything: partial last row block and K group
    (40, 200, 96, (128, 32)),   # prefill tiles, N spanning a partial 128-row block
    (17, 48, 130, (32, 64)),
])
def test_matches_reference(m, n, k, block):
    w, w_scale = make_weight(n, k, block)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    a, a_scale = per_token_group_quant_fp8(x, block[1])
    got = fp8_block_gemm(a, a_scale, w, w_scale, block, torch.float32)
    ref = fp8_block_gemm_ref(a, a_scale, w, w_scale, block, torch.float32)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    bias = torch.randn(n).to(DEVICE)
    torch.testing.assert_close(fp8_block_linear(x, w, w_scale, block, bias), ref + bias, atol=1e-4, rtol=1e-4)


def test_activation_quantization_is_per_token_per_group():
    x = torch.randn(3, 70) * torch.tensor([1.0, 100.0, 0.01])[:, None]
    x[2] = 0.0  # an all-zero row: a positive scale, zeros out
    q, scale = per_token_group_quant_fp8(x, 32)
    assert q.dtype == FP8_DTYPE and scale.shape == (3, 3) and (scale > 0).all()
    assert torch.equal(q[2].float(), torch.zeros(70))
    back = dequantize_block_fp8(q, scale, (1, 32))
    assert ((back - x).abs() <= x.abs() / 16 + 1e-30).all()  # e4m3: 3 mantissa bits
    groups = torch.nn.functional.pad(x[:2], (0, 26)).view(2, 3, 32).abs().amax(-1)
    torch.testing.assert_close(scale[:2], groups / 448)


def test_bf16_output():
    w, w_scale = make_weight(64, 64, (16, 32))
    x = torch.randn(4, 64).to(DEVICE, torch.bfloat16)
    a, a_scale = per_token_group_quant_fp8(x, 32)
    got = fp8_block_gemm(a, a_scale, w, w_scale, (16, 32), torch.bfloat16)
    ref = fp8_block_gemm_ref(a, a_scale, w, w_scale, (16, 32), torch.float32)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), ref, atol=1e-2, rtol=1e-2)


def test_bad_arguments_are_named():
    w, w_scale = make_weight(64, 64, (16, 32))
    a, a_scale = per_token_group_quant_fp8(torch.randn(2, 64).to(DEVICE), 32)
    with pytest.raises(ValueError, match="bk=24"):
        fp8_block_gemm(a, a_scale, w, w_scale, (16, 24), torch.float32)
    with pytest.raises(ValueError, match="b_scale has shape"):
        fp8_block_gemm(a, a_scale, w, w_scale[:2], (16, 32), torch.float32)
    with pytest.raises(ValueError, match="a must be a 2-D torch.float8_e4m3fn"):
        fp8_block_gemm(a.float(), a_scale, w, w_scale, (16, 32), torch.float32)
    with pytest.raises(ValueError, match="differ in K"):
        fp8_block_gemm(a[:, :32], a_scale[:, :1], w, w_scale, (16, 32), torch.float32)
    with pytest.raises(ValueError, match="block_size must be"):
        fp8_block_linear(torch.randn(2, 64), w, w_scale, (16,))
