"""engine.layers.attention.Attention: the per-layer sliding window, soft cap and sinks reach the
kernels of both backends, and the sinks parameter loads this TP rank's heads."""
import math

import pytest
import torch

from tests.triton_device import DEVICE  # before kernels: sets the interpreter up

import engine.layers.attention as attention_module  # noqa: E402
from engine.layers.attention import Attention  # noqa: E402
from engine.worker.forward_context import set_forward_context  # noqa: E402
from kernels.reference import paged_attention_ref  # noqa: E402
from tests.test_models import BLOCK_SIZE, make_step  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 32


def _layer(backend: str, **options) -> Attention:
    layer = Attention(HEADS, HEAD_DIM, HEAD_DIM ** -0.5, KV_HEADS, **options)
    if layer.sinks is not None:
        layer.sinks.data.copy_(torch.tensor([0.5, -1.0, 2.0, 0.0]))
    layer.set_backend(backend)
    shape = (2 * 8, BLOCK_SIZE, KV_HEADS, HEAD_DIM)  # make_step: sequence s owns blocks 8s .. 8s + 7
    layer.k_cache, layer.v_cache = torch.zeros(shape, device=DEVICE), torch.zeros(shape, device=DEVICE)
    return layer.to(DEVICE)


@torch.inference_mode()
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_score_options_reach_the_kernels(backend):
    """A prefill step, then a mixed step (a chunk over a prefix and a decode), each equal to the
    reference over the layer's own cache with the layer's window, cap and sinks."""
    layer = _layer(backend, sliding_window=6, logits_soft_cap=2.5, sinks=True)
    gen = torch.Generator().manual_seed(0)
    for chunks in ([(0, [0] * 20, 0), (1, [0] * 9, 0)], [(0, [0] * 7, 20), (1, [0], 9)]):
        _, _, md = make_step(chunks, DEVICE)
        n = md.slot_mapping.shape[0]
        q = torch.randn(n, HEADS * HEAD_DIM, generator=gen).to(DEVICE)
        k, v = (torch.randn(n, KV_HEADS * HEAD_DIM, generator=gen).to(DEVICE) for _ in range(2))
        with set_forward_context(md):
            out = layer(q, k, v)
        ref = paged_attention_ref(q.view(n, HEADS, HEAD_DIM), layer.k_cache, layer.v_cache, md.block_tables,
                                  md.seq_lens, md.cu_seqlens_q, md.max_seqlen_q, layer.scale,
                                  sliding_window=6, logits_soft_cap=2.5, sinks=layer.sinks)
        torch.testing.assert_close(out.view(n, HEADS, HEAD_DIM), ref, atol=2e-4, rtol=2e-4)


def test_sinks_load_this_ranks_heads(monkeypatch):
    monkeypatch.setattr(attention_module, "get_tp_rank", lambda: 1)
    monkeypatch.setattr(attention_module, "get_tp_size", lambda: 2)
    layer = Attention(2, HEAD_DIM, 1.0, 1, sinks=True)  # this rank's 2 of 4 heads
    layer.sinks.weight_loader(layer.sinks, torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert layer.sinks.tolist() == [3.0, 4.0]
    assert [name for name, _ in layer.named_parameters()] == ["sinks"]
    with pytest.raises(ValueError, match=r"checkpoint sinks have shape \(2,\), expected \(4,\)"):
        layer.sinks.weight_loader(layer.sinks, torch.zeros(2))


def test_a_plain_layer_has_no_sinks_parameter():
    assert list(Attention(HEADS, HEAD_DIM, 1.0, KV_HEADS).parameters()) == []


@pytest.mark.parametrize("options, message", [
    (dict(sliding_window=0), "sliding_window=0 is invalid"),
    (dict(logits_soft_cap=-1.0), "logits_soft_cap=-1.0 is invalid"),
    (dict(logits_soft_cap=math.nan), "logits_soft_cap=nan is invalid"),
])
def test_bad_options_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        Attention(HEADS, HEAD_DIM, 1.0, KV_HEADS, **options)
