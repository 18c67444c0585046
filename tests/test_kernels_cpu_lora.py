"""kernels/cpu_lora.c (through kernels/cpu_lora.py) against the float64 oracles of kernels/reference.py,
with the slots laid out as engine/layers/lora.py lays them (B stored transposed)."""
import pytest
import torch

from kernels import cpu_lora
from kernels.reference import lora_expand_ref, lora_shrink_ref

pytestmark = pytest.mark.skipif(cpu_lora._lib() is None, reason="the C kernel did not build here")


def make_case(token_slots, part_sizes, ranks, max_rank, in_size=40, seed=0):
    gen = torch.Generator().manual_seed(seed)
    num_parts, out = len(part_sizes), sum(part_sizes)
    offsets = [sum(part_sizes[:p]) for p in range(num_parts + 1)]
    a = torch.zeros(len(ranks), num_parts * max_rank, in_size)
    b_t = torch.zeros(len(ranks), num_parts * max_rank, out)  # the engine's storage: B^T
    for s, r in enumerate(ranks):
        for p in range(num_parts):
            a[s, p * max_rank:p * max_rank + r] = torch.randn(r, in_size, generator=gen)
            b_t[s, p * max_rank:p * max_rank + r, offsets[p]:offsets[p + 1]] = torch.randn(r, part_sizes[p],
                                                                                           generator=gen)
    x = torch.randn(len(token_slots), in_size + 3, generator=gen)[:, :in_size]  # rows with a stride
    y = torch.randn(len(token_slots), out, generator=gen)
    return x, y, a, b_t.transpose(1, 2), torch.tensor(token_slots, dtype=torch.int32), torch.tensor(offsets)


@pytest.mark.parametrize("token_slots, part_sizes, ranks, max_rank", [
    ([1, -1, 0, 1, -1, 0, 0], [24, 8, 8], [8, 3], 8),     # qkv: base rows, a rank below the max
    ([2, 0, 0, -1, 2], [37], [4, 8, 2, 8], 16),            # one part, an idle slot, widths off the vector size
    ([1] * 5, [16, 21], [5, 16], 16),                      # gate_up, every row one adapter
])
def test_delta_equals_the_reference(token_slots, part_sizes, ranks, max_rank):
    x, y, a, b, slots, offsets = make_case(token_slots, part_sizes, ranks, max_rank)
    b_nan = b.clone()  # off the diagonal blocks: never read
    for p in range(len(part_sizes)):
        block = b_nan[:, offsets[p]:offsets[p + 1]]
        block[:, :, :p * max_rank] = float("nan")
        block[:, :, (p + 1) * max_rank:] = float("nan")
    ref = y.clone()
    lora_expand_ref(lora_shrink_ref(x, a, token_slots), b, ref, token_slots)
    assert cpu_lora.lora_delta(y, x, a, b_nan, slots, offsets) is True
    torch.testing.assert_close(y, ref, atol=1e-4, rtol=1e-4)


def test_inputs_it_does_not_take_are_left_to_the_torch_path():
    x, y, a, b, slots, offsets = make_case([0, -1], [24, 8, 8], [8], 8)
    before = y.clone()
    assert cpu_lora.lora_delta(y, x.double(), a, b, slots, offsets) is None           # not fp32
    assert cpu_lora.lora_delta(y, x, a, b.contiguous(), slots, offsets) is None       # B not stored transposed
    assert cpu_lora.lora_delta(y, x, a, b, slots.long(), offsets) is None             # int64 slots
    assert cpu_lora.lora_delta(y, x, a, b, torch.tensor([0, 1], dtype=torch.int32), offsets) is None  # slot 1 of 1
    assert cpu_lora.lora_delta(y, x, a, b, slots, torch.tensor([0, 24, 32, 41])) is None  # past the outputs
    assert torch.equal(y, before)
