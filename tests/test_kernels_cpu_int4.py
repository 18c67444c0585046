"""The CPU int4 C kernel (kernels.cpu_int4) against int4_gemm_torch, the exact reference: its three
paths (codes unpacked in registers, through a dequantized buffer, dense tiles for torch), group
orders act-order leaves, odd shapes; bad arguments named; the layer's torch fallback when disabled."""
import pytest
import torch
from torch import nn

from engine.layers.quantization import int4_common
from engine.layers.quantization.int4_common import Int4LinearMethod, pack_rows
from kernels import cpu_int4
from kernels.cpu_build import DISABLE_ENV, load_kernel_library
from kernels.triton_int4_gemm import int4_gemm_torch

needs_kernel = pytest.mark.skipif(not cpu_int4.available(), reason="the C kernel could not be built here")
TOL = dict(atol=1e-4, rtol=1e-5)  # fp32 sums in another order


def make_int4(n: int, k: int, group_size: int, act_order: bool = False, seed: int = 0, g_idx=None):
    """Random weights in the shared layout: qweight [K / 8, N], fp16 scales and uint8 zeros [G, N],
    g_idx [K] (given, or k // group_size, permuted for act-order)."""
    gen = torch.Generator().manual_seed(seed)
    if g_idx is None:
        g_idx = torch.arange(k, dtype=torch.int32) // group_size
        if act_order:
            g_idx = g_idx[torch.randperm(k, generator=gen)]
    groups = int(g_idx.max()) + 1
    codes = torch.randint(0, 16, (k, n), generator=gen)
    scales = (torch.rand(groups, n, generator=gen) * 0.1 + 0.01).half()
    zeros = torch.randint(0, 17, (groups, n), generator=gen).to(torch.uint8)  # 16: GPTQ v1's zero + 1
    return pack_rows(codes), scales, zeros, g_idx


def check_against_reference(x, int4, bias=None):
    expected = int4_gemm_torch(x.float(), *int4)
    if bias is not None:
        expected = expected + bias
    out = cpu_int4.int4_linear_cpu(x, cpu_int4.pack_int4_cpu(*int4), bias)
    assert out.dtype == x.dtype and out.shape == expected.shape
    torch.testing.assert_close(out.float(), expected, **TOL)


@needs_kernel
# registers (up to DIRECT_MAX_ROWS), a dequantized buffer, dense tiles for torch (DENSE_MIN_ROWS on)
@pytest.mark.parametrize("rows", [1, 3, cpu_int4.DIRECT_MAX_ROWS, cpu_int4.DIRECT_MAX_ROWS + 5, cpu_int4.DENSE_MIN_ROWS + 3])
@pytest.mark.parametrize("group_size, act_order", [(32, False), (64, True), (128, False), (128, True), (None, False)])
def test_matches_the_reference(rows, group_size, act_order):
    n, k = 37, 256  # an odd N: a partial block of 4 outputs
    int4 = make_int4(n, k, group_size or k, act_order, seed=rows)
    check_against_reference(torch.randn(rows, k), int4, bias=torch.randn(n) if rows % 2 else None)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 5, cpu_int4.DIRECT_MAX_ROWS + 3, cpu_int4.DENSE_MIN_ROWS + 1])
@pytest.mark.parametrize("k", [40, 200, 584])  # K % 32 = 8, 8, 8: a short last block (and K % 16 = 8)
def test_k_off_the_32_input_blocks(rows, k):
    int4 = make_int4(24, k, k, seed=k)  # per channel: one group over all of K
    check_against_reference(torch.randn(rows, k), int4, torch.randn(24))


@needs_kernel
@pytest.mark.parametrize("rows", [2, cpu_int4.DIRECT_MAX_ROWS + 1, cpu_int4.DENSE_MIN_ROWS])
def test_groups_of_any_length_in_any_order(rows):
    """A row-parallel rank's act-order rows: groups of a few rows, scattered, some absent here."""
    g_idx = torch.randint(0, 23, (200,), dtype=torch.int32, generator=torch.Generator().manual_seed(rows))
    g_idx[g_idx == 5], g_idx[-1] = 6, 22  # group 5 held only by the other rank
    int4 = make_int4(19, 200, 8, g_idx=g_idx)
    assert cpu_int4.pack_int4_cpu(*int4).bounds.numel() - 1 == 22  # the absent group dropped
    check_against_reference(torch.randn(rows, 200), int4)


@needs_kernel
def test_bf16_activations_strided_rows_and_no_rows():
    int4 = make_int4(64, 128, 32)
    wide = torch.randn(6, 300)
    check_against_reference(wide[:, 10:138], int4)  # rows 300 floats apart
    x = torch.randn(4, 128).bfloat16()
    out = cpu_int4.int4_linear_cpu(x, cpu_int4.pack_int4_cpu(*int4))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), int4_gemm_torch(x.float(), *int4).bfloat16().float(), atol=0, rtol=0)
    assert cpu_int4.int4_linear_cpu(x[:0], cpu_int4.pack_int4_cpu(*int4)).shape == (0, 64)


def test_the_packed_layout_keeps_the_bytes():
    qweight, scales, zeros, g_idx = make_int4(48, 256, 64, act_order=True)
    packed = cpu_int4.pack_int4_cpu(qweight, scales, zeros, g_idx)
    assert packed.codes.numel() == qweight.numel() * 4 and packed.codes.dtype == torch.uint8
    assert packed.scales.numel() == scales.numel() and packed.zeros.numel() == zeros.numel()
    assert packed.perm.numel() == 256  # act-order: x's columns are gathered per call
    assert cpu_int4.pack_int4_cpu(*make_int4(48, 256, 64)).perm.numel() == 0  # in order: nothing to gather


@pytest.mark.parametrize("call, named", [
    (lambda w: cpu_int4.int4_linear_cpu(torch.randn(2, 64).int(), w), "x must be a 2-D float32 or bfloat16"),
    (lambda w: cpu_int4.int4_linear_cpu(torch.randn(2, 3, 64), w), r"got torch.float32 \(2, 3, 64\)"),
    (lambda w: cpu_int4.int4_linear_cpu(torch.randn(2, 72), w), "x has 72 input features; the weight has 64"),
    (lambda w: cpu_int4.int4_linear_cpu(torch.randn(2, 64), w, torch.randn(15)), r"bias must .* shape \(16,\)"),
    (lambda w: cpu_int4.CpuInt4Weights(w.codes, w.scales.float(), w.zeros, w.bounds, w.perm), "scales must"),
    (lambda w: cpu_int4.CpuInt4Weights(w.codes[:, :8].contiguous(), w.scales, w.zeros, w.bounds, w.perm), "bounds must"),
    (lambda w: cpu_int4.CpuInt4Weights(w.codes, w.scales, w.zeros, w.bounds, w.perm[:5]), "perm must"),
])
def test_bad_arguments_are_named(call, named):
    w = cpu_int4.pack_int4_cpu(*make_int4(16, 64, 32, act_order=True))
    with pytest.raises(ValueError, match=named):
        call(w)


def test_scales_other_than_fp16_are_refused_at_packing():
    qweight, scales, zeros, g_idx = make_int4(16, 64, 32)
    with pytest.raises(ValueError, match="scales must be float16 .* got torch.bfloat16"):
        cpu_int4.pack_int4_cpu(qweight, scales.bfloat16(), zeros, g_idx)


class GivenLayout(Int4LinearMethod):
    """A linear method whose checkpoint is already the shared layout (AWQ / GPTQ repack to it)."""

    def __init__(self, tensors: dict):
        self.tensors = tensors

    def to_shared_layout(self, layer: nn.Module) -> None:
        for name, t in self.tensors.items():
            layer.register_parameter(name, nn.Parameter(t.clone(), requires_grad=False))


def loaded_layer(tensors: dict) -> tuple[nn.Module, Int4LinearMethod]:
    layer, method = nn.Module(), GivenLayout(tensors)
    method.process_weights_after_loading(layer)
    return layer, method


@pytest.fixture
def kernel_disabled(monkeypatch):
    """RAYLLM_DISABLE_CPU_KERNEL=1 for one test, the cached library forgotten on both sides."""
    monkeypatch.setenv(DISABLE_ENV, "1")
    cpu_int4._lib.cache_clear(), load_kernel_library.cache_clear()
    yield
    monkeypatch.delenv(DISABLE_ENV)
    cpu_int4._lib.cache_clear(), load_kernel_library.cache_clear()


@needs_kernel
def test_a_layer_on_cpu_computes_with_the_kernel():
    int4 = make_int4(40, 128, 32, act_order=True)
    layer, method = loaded_layer(dict(zip(("qweight", "scales", "zeros", "g_idx"), int4)))
    assert method.gemm is int4_common.cpu_kernel_gemm and not hasattr(layer, "qweight")
    x, bias = torch.randn(2, 3, 128), torch.randn(40)
    expected = int4_gemm_torch(x.reshape(6, 128), *int4) + bias
    torch.testing.assert_close(method.apply(layer, x, bias), expected.reshape(2, 3, 40), **TOL)


def test_the_fallback_when_disabled_gives_the_same(kernel_disabled):
    int4 = make_int4(40, 128, 32, act_order=True)
    layer, method = loaded_layer(dict(zip(("qweight", "scales", "zeros", "g_idx"), int4)))
    assert method.gemm is int4_common.shared_layout_gemm and layer.qweight.shape == (16, 40)
    x, bias = torch.randn(5, 128), torch.randn(40)
    torch.testing.assert_close(method.apply(layer, x, bias), int4_gemm_torch(x, *int4) + bias, atol=0, rtol=0)
    with pytest.raises(RuntimeError, match="not available"):
        cpu_int4.int4_linear_cpu(x, cpu_int4.pack_int4_cpu(*int4))
