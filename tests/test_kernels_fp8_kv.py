"""The fp8 KV cache in the kernels: store_kv quantizes, paged attention dequantizes.

Triton kernels run under the interpreter on CPU (natively on a GPU), the torch path as is; both
against kernels/reference.py, which quantizes with kernels/fp8_kv.py. Stores are bit-exact (the
same rounding everywhere); attention is held to the dtype's usual tolerance, since the reference
reads the very same e4m3 bytes.
"""
import pytest
import torch

from tests.triton_device import DEVICE  # before kernels: sets the interpreter up

from kernels import paged_attention, paged_attention_ref, paged_attention_torch  # noqa: E402
from kernels import store_kv, store_kv_ref, store_kv_torch  # noqa: E402
from kernels.fp8_kv import FP8_DTYPE, FP8_MAX, dequantize_fp8, quantize_fp8  # noqa: E402
from tests.test_kernels_attention import CASES, TOL, make_batch  # noqa: E402

STORES = {"triton": lambda: store_kv, "torch": lambda: store_kv_torch}
ATTENTIONS = {"triton": lambda: paged_attention, "torch": lambda: paged_attention_torch}


def _scale(x: float) -> torch.Tensor:
    return torch.tensor([x], dtype=torch.float32, device=DEVICE)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)  # compares -0.0 with 0.0 and NaN with NaN as what they are


def test_quantize_saturates_and_rounds_to_nearest_even():
    x = torch.tensor([1e6, -1e6, 448.0, 449.0, 0.0, -0.0009, 1.0625, 1.1875, 2.0**-10, 3 * 2.0**-10])
    q = quantize_fp8(x, _scale(1.0).cpu())
    assert q.dtype == FP8_DTYPE
    # Saturated (no inf, no NaN); -0.0009 is under half the smallest step (2^-9); 1.0625 is a tie between 1.0 and 1.125 -> even 1.0, 1.1875 -> 1.25;
    # subnormals step by 2^-9: 2^-10 is a tie -> 0, 3 * 2^-10 -> 2 * 2^-9.
    want = [FP8_MAX, -FP8_MAX, 448.0, 448.0, 0.0, -0.0, 1.0, 1.25, 0.0, 2.0**-8]
    assert q.float().tolist() == want
    assert torch.signbit(q.float()[5])  # -0.0009 keeps its sign, as every path must
    assert dequantize_fp8(quantize_fp8(x, _scale(4.0).cpu()), _scale(4.0).cpu(), torch.float32)[0] == 4 * FP8_MAX


def _kv_rows(num_tokens, kv_heads, head_dim, dtype, gen):
    """K/V with magnitudes from 1e-4 to 1e3 along head_dim: subnormal, normal and saturated
    values for the scales below, both signs."""
    mags = torch.logspace(-4, 3, head_dim)
    key = torch.randn(num_tokens, kv_heads, head_dim, generator=gen) * mags
    value = torch.randn(num_tokens, kv_heads, head_dim, generator=gen) * mags.flip(0)
    return key.to(dtype).to(DEVICE), value.to(dtype).to(DEVICE)


@pytest.mark.parametrize("backend", list(STORES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kv_heads,head_dim,block_size", [(2, 64, 16), (3, 80, 8)])
def test_store_matches_reference_bit_exact(backend, dtype, kv_heads, head_dim, block_size):
    gen = torch.Generator().manual_seed(1)
    num_blocks, num_tokens = 5, 30
    key, value = _kv_rows(num_tokens, kv_heads, head_dim, dtype, gen)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::4] = -1  # padding rows: skipped
    slots = slots.to(DEVICE)
    k_scale, v_scale = _scale(0.37), _scale(2.5)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    # Untouched slots keep a marker byte, so a stray or skipped write shows up.
    want_k, want_v, got_k, got_v = (torch.full(shape, 0x7E, dtype=torch.uint8, device=DEVICE).view(FP8_DTYPE)
                                    for _ in range(4))
    store_kv_ref(key, value, want_k, want_v, slots, k_scale, v_scale)
    STORES[backend]()(key, value, got_k, got_v, slots, k_scale, v_scale)
    assert torch.equal(_bytes(got_k), _bytes(want_k))
    assert torch.equal(_bytes(got_v), _bytes(want_v))
    assert bool((want_k.float().abs() == FP8_MAX).any())  # the case did saturate


def _fp8_batch(case, dtype, k_scale, v_scale):
    q_lens, seq_lens, heads, kv_heads, head_dim, block_size = CASES[case]
    batch = make_batch(q_lens, seq_lens, heads, kv_heads, head_dim, block_size, dtype)
    # Unit-variance K/V at scales 0.02 / 0.05 use e4m3's range from ~2^-3 to 2^7.
    batch["k_cache"] = quantize_fp8(batch["k_cache"], k_scale)
    batch["v_cache"] = quantize_fp8(batch["v_cache"], v_scale)
    return batch


FP8_CASES = ["decode_block_edges_bs16", "prefill_chunk_with_prefix_d80", "mixed_gqa8_d128_bs32",
             "gather_bs24"]


@pytest.mark.parametrize("backend", list(ATTENTIONS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", FP8_CASES)
def test_attention_over_fp8_cache_matches_reference(backend, dtype, case):
    k_scale, v_scale = _scale(0.02), _scale(0.05)
    batch = _fp8_batch(case, dtype, k_scale, v_scale)
    ref = paged_attention_ref(**batch, k_scale=k_scale, v_scale=v_scale)
    out = torch.full_like(batch["query"], float("nan"))
    ATTENTIONS[backend]()(**batch, out=out, k_scale=k_scale, v_scale=v_scale)
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])
    # The scales are applied: reading the bytes unscaled gives another answer.
    unscaled = paged_attention_ref(**batch, k_scale=_scale(1.0), v_scale=_scale(1.0))
    assert (unscaled.float() - ref.float()).abs().max() > 10 * TOL[dtype]


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("options", [{}, {"sliding_window": 9}, {"logits_soft_cap": 4.0, "sinks": True}],
                         ids=["plain", "window", "softcap_sinks"])
def test_triton_split_and_score_options_with_fp8(num_splits, options):
    k_scale, v_scale = _scale(0.02), _scale(0.05)
    batch = _fp8_batch("decode_block_edges_bs16", torch.float16, k_scale, v_scale)
    opts = dict(options)
    if opts.pop("sinks", False):
        opts["sinks"] = torch.linspace(-1.0, 2.0, batch["query"].shape[1], device=DEVICE)
    ref = paged_attention_ref(**batch, k_scale=k_scale, v_scale=v_scale, **opts)
    out = paged_attention(**batch, k_scale=k_scale, v_scale=v_scale, num_splits=num_splits, **opts)
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[torch.float16], rtol=TOL[torch.float16])


@pytest.mark.parametrize("backend", list(ATTENTIONS))
def test_store_then_attend_roundtrip(backend):
    """What store_kv writes is what attention reads: a prefill stored through the backend equals the
    full-precision attention within e4m3's error (3 mantissa bits: <= 2^-4 relative per value)."""
    gen = torch.Generator().manual_seed(3)
    num_tokens, heads, kv_heads, head_dim, block_size = 24, 4, 2, 64, 16
    key = torch.randn(num_tokens, kv_heads, head_dim, generator=gen).to(DEVICE)
    value = torch.randn(num_tokens, kv_heads, head_dim, generator=gen).to(DEVICE)
    query = torch.randn(num_tokens, heads, head_dim, generator=gen).to(DEVICE)
    shape = (3, block_size, kv_heads, head_dim)
    slots = torch.arange(num_tokens, device=DEVICE)
    meta = dict(block_tables=torch.tensor([[0, 1, 2]], dtype=torch.int32, device=DEVICE),
                seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=DEVICE),
                cu_seqlens_q=torch.tensor([0, num_tokens], dtype=torch.int32, device=DEVICE),
                max_seqlen_q=num_tokens, softmax_scale=head_dim ** -0.5)
    k8, v8 = (torch.zeros(shape, dtype=FP8_DTYPE, device=DEVICE) for _ in "kv")
    k_scale, v_scale = _scale(0.03), _scale(0.01)
    STORES[backend]()(key, value, k8, v8, slots, k_scale, v_scale)
    got = ATTENTIONS[backend]()(query, k8, v8, **meta, k_scale=k_scale, v_scale=v_scale)
    k32, v32 = (torch.zeros(shape, device=DEVICE) for _ in "kv")
    store_kv_ref(key, value, k32, v32, slots)
    full = paged_attention_ref(query, k32, v32, **meta)
    # e4m3 keeps 3 mantissa bits: each value within 2^-4 = 6.25% relative. The output's rms
    # relative error measured 3.1% here (K's errors pass through the softmax's exponent too);
    # the bound is e4m3's per-value worst case, the floor says it really was quantized.
    rel = ((got - full).norm() / full.norm()).item()
    assert 1e-3 < rel < 0.0625, rel


@pytest.mark.parametrize("backend", list(STORES))
def test_scale_rules_name_the_bad_value(backend):
    key = torch.randn(2, 1, 16, device=DEVICE)
    slots = torch.tensor([0, 1], device=DEVICE)
    k8, v8 = (torch.zeros(1, 8, 1, 16, dtype=FP8_DTYPE, device=DEVICE) for _ in "kv")
    with pytest.raises(ValueError, match="k_scale is required"):
        STORES[backend]()(key, key, k8, v8, slots)
    with pytest.raises(ValueError, match=r"per-tensor, shape \[1\]; got shape \(2,\)"):
        STORES[backend]()(key, key, k8, v8, slots, torch.ones(2, device=DEVICE), _scale(1.0))
    with pytest.raises(ValueError, match="v_scale has dtype torch.float16"):
        STORES[backend]()(key, key, k8, v8, slots, _scale(1.0), _scale(1.0).half())
    k32, v32 = (torch.zeros(1, 8, 1, 16, device=DEVICE) for _ in "kv")
    with pytest.raises(ValueError, match="apply to an torch.float8_e4m3fn cache only; the cache is torch.float32"):
        STORES[backend]()(key, key, k32, v32, slots, _scale(1.0), _scale(1.0))


def test_cpu_kernel_paths_refuse_an_fp8_cache_without_scales():
    """The engine's CPU entry points (C kernel) take no scales: an fp8 cache must not reach them."""
    from kernels.cpu_attention import paged_attention_cpu, store_kv_cpu

    batch = _fp8_batch("decode_block_edges_bs16", torch.float32, _scale(1.0).cpu(), _scale(1.0).cpu())
    batch = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    with pytest.raises(ValueError, match="k_scale is required"):
        paged_attention_cpu(**batch)
    key = torch.randn(1, batch["k_cache"].shape[2], batch["k_cache"].shape[3])
    with pytest.raises(ValueError, match="k_scale is required"):
        store_kv_cpu(key, key, batch["k_cache"], batch["v_cache"], torch.tensor([0]))
