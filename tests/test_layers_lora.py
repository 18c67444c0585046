"""engine/layers/lora.py: each TP rank's slots hold its shard of the adapter, and the ranks'
deltas put together (column: concatenated rows; row: summed partials) are the full layer's
scaling * x @ A.T @ B.T, part by part for the fused layers. Ranks are simulated in one process."""
from __future__ import annotations

import pytest
import torch

from engine.layers import linear
from engine.layers import lora as lora_layer
from engine.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from engine.layers.lora import LoRASlots
from engine.worker.forward_context import LoRAMapping, set_forward_context
from kernels import cpu_lora

HIDDEN, HEAD_DIM, HEADS, MAX_RANK = 16, 4, 4, 8


def _layer(monkeypatch, make, rank: int, size: int):
    monkeypatch.setattr(linear, "get_tp_rank", lambda: rank)
    monkeypatch.setattr(linear, "get_tp_size", lambda: size)
    return make()


def _delta(slots: LoRASlots, x: torch.Tensor, mapping: LoRAMapping) -> torch.Tensor:
    y = torch.zeros(x.shape[0], slots.lora_b.shape[1])
    with set_forward_context(None, mapping):
        slots.add_delta(x, y)
    return y


def _parts(gen, spec: list[tuple[object, int, int]], rank: int) -> list:
    """(shard_id, A [rank, in], B [out, rank]) of each part, random."""
    return [(sid, torch.randn(rank, n_in, generator=gen), torch.randn(n_out, rank, generator=gen))
            for sid, n_in, n_out in spec]


@pytest.mark.parametrize("num_kv_heads,tp_size", [(2, 1), (2, 2), (1, 2)])  # (1, 2): the KV head replicated
def test_qkv_ranks_put_together_equal_the_full_delta(monkeypatch, num_kv_heads, tp_size):
    gen = torch.Generator().manual_seed(0)
    q, kv = HEADS * HEAD_DIM, num_kv_heads * HEAD_DIM
    parts = _parts(gen, [("q", HIDDEN, q), ("k", HIDDEN, kv), ("v", HIDDEN, kv)], rank=3)
    x = torch.randn(5, HIDDEN, generator=gen)
    full = [0.5 * (x @ a.T) @ b.T for _, a, b in parts]  # per part [5, out_part]
    per_rank = []
    for rank in range(tp_size):
        layer = _layer(monkeypatch, lambda: QKVParallelLinear(HIDDEN, HEAD_DIM, HEADS, num_kv_heads), rank, tp_size)
        slots = LoRASlots(layer, 3, max_loras=2, max_rank=MAX_RANK, dtype=torch.float32, device=torch.device("cpu"))
        slots.set_slot(1, parts, scaling=0.5)
        y = _delta(slots, x, LoRAMapping([1], [None]))
        per_rank.append(y.split([layer.q_size, layer.kv_size, layer.kv_size], dim=-1))
    torch.testing.assert_close(torch.cat([r[0] for r in per_rank], -1), full[0])
    replicas = max(1, tp_size // num_kv_heads)
    for p in (1, 2):  # rank r holds KV head r // replicas
        kv_heads = [per_rank[r][p] for r in range(0, tp_size, replicas)]
        torch.testing.assert_close(torch.cat(kv_heads, -1), full[p])


def test_merged_part_without_adapter_stays_zero_and_rows_follow_the_mapping(monkeypatch):
    gen = torch.Generator().manual_seed(1)
    layer = _layer(monkeypatch, lambda: MergedColumnParallelLinear(HIDDEN, [12, 12]), 0, 1)
    slots = LoRASlots(layer, 2, max_loras=2, max_rank=MAX_RANK, dtype=torch.float32, device=torch.device("cpu"))
    (_, a, b), = parts = _parts(gen, [(1, HIDDEN, 12)], rank=MAX_RANK)  # "up" only
    slots.set_slot(0, parts, scaling=2.0)
    x = torch.randn(4, HIDDEN, generator=gen)
    y = _delta(slots, x, LoRAMapping([0], [torch.tensor([1, 3])]))  # rows 0 and 2: the base model
    expected = torch.zeros(4, 24)
    expected[[1, 3], 12:] = 2.0 * (x[[1, 3]] @ a.T) @ b.T
    torch.testing.assert_close(y, expected)
    slots.clear_slot(0)
    assert not _delta(slots, x, LoRAMapping([0], [None])).any()


def test_row_parallel_partials_sum_to_the_full_delta(monkeypatch):
    gen = torch.Generator().manual_seed(2)
    parts = _parts(gen, [(None, 24, HIDDEN)], rank=4)
    _, a, b = parts[0]
    x = torch.randn(3, 24, generator=gen)
    total = torch.zeros(3, HIDDEN)
    for rank in range(2):
        layer = _layer(monkeypatch, lambda: RowParallelLinear(24, HIDDEN), rank, 2)
        slots = LoRASlots(layer, 1, max_loras=1, max_rank=MAX_RANK, dtype=torch.float32, device=torch.device("cpu"))
        slots.set_slot(0, parts, scaling=1.0)
        total += _delta(slots, x[:, rank * 12:(rank + 1) * 12], LoRAMapping([0], [None]))  # what all_reduce sums
    torch.testing.assert_close(total, (x @ a.T) @ b.T)


def test_no_mapping_adds_nothing(monkeypatch):
    layer = _layer(monkeypatch, lambda: RowParallelLinear(8, 8), 0, 1)
    slots = LoRASlots(layer, 1, max_loras=1, max_rank=2, dtype=torch.float32, device=torch.device("cpu"))
    slots.lora_a.fill_(1.0)
    slots.lora_b.fill_(1.0)
    assert not _delta(slots, torch.ones(2, 8), None).any()


def test_cpu_kernel_and_torch_loop_add_the_same_delta(monkeypatch):
    """With the rows' slots (token_slots) the C kernel runs (kernels/cpu_lora.c); without, the torch loop."""
    gen = torch.Generator().manual_seed(3)
    layer = _layer(monkeypatch, lambda: QKVParallelLinear(HIDDEN, HEAD_DIM, HEADS, 2), 0, 1)
    slots = LoRASlots(layer, 3, max_loras=2, max_rank=MAX_RANK, dtype=torch.float32, device=torch.device("cpu"))
    slots.set_slot(0, _parts(gen, [("q", HIDDEN, 16), ("v", HIDDEN, 8)], rank=5), scaling=0.5)
    slots.set_slot(1, _parts(gen, [("q", HIDDEN, 16), ("k", HIDDEN, 8), ("v", HIDDEN, 8)], rank=8), scaling=2.0)
    x = torch.randn(5, HIDDEN, generator=gen)
    row_slots = [1, -1, 0, 1, 0]
    loop = LoRAMapping([1, 0], [torch.tensor([0, 3]), torch.tensor([2, 4])])
    kernel = LoRAMapping(loop.slots, loop.row_indices, torch.tensor(row_slots, dtype=torch.int32))
    calls = []
    monkeypatch.setattr(lora_layer, "lora_delta", lambda *args: calls.append(1) or cpu_lora.lora_delta(*args))
    expected = _delta(slots, x, loop)
    assert not calls
    torch.testing.assert_close(_delta(slots, x, kernel), expected, atol=1e-5, rtol=1e-5)
    assert calls == [1] and not expected[1].any() and expected[[0, 2, 3, 4]].any(dim=-1).all()  # row 1: base
