"""The token -> slot mapping of a step, as the LoRA kernels (kernels/triton_lora.py) read it, and the
checks of their arguments. No triton: the engine builds the mapping on any device.

    token_slots       [ 1  -1   0   1   0 ]            each row's adapter slot (-1: the base model)
    sorted_token_ids  [ 2   4 | 0   3 | 1 ]            rows of slot 0, of slot 1, then base rows
    slot_starts       [ 0       2       4 ]            slot s: sorted_token_ids[starts[s] : starts[s+1]]

Base rows sit past slot_starts[max_loras]: no kernel reads or writes them. The checks read shapes,
dtypes and devices only: reading the contents would sync the GPU on every layer.
"""
from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def sort_tokens_by_slot(token_slots: list[int], max_loras: int) -> tuple[list[int], list[int]]:
    """Host lists for the kernels: (sorted_token_ids [num_tokens], slot_starts [max_loras + 1]).
    Rows of slot 0 first, then slot 1, ..., each in row order; base rows (-1) last."""
    by_slot: list[list[int]] = [[] for _ in range(max_loras)]
    base = []
    for row, slot in enumerate(token_slots):
        if slot < 0:
            base.append(row)
        elif slot < max_loras:
            by_slot[slot].append(row)
        else:
            raise ValueError(f"token_slots[{row}]={slot} is out of range for max_loras={max_loras}")
    starts = [0]
    for rows in by_slot:
        starts.append(starts[-1] + len(rows))
    return [row for rows in by_slot for row in rows] + base, starts


def _fail(msg: str) -> None:
    raise ValueError(msg)


def _check_tensor(name: str, t, ndim: int, dtypes) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != ndim or t.dtype not in dtypes:
        got = f"{t.dtype} of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        _fail(f"{name} must be a {ndim}-D tensor of {', '.join(map(str, dtypes))}; got {got}")


def check_lora_mapping(num_tokens: int, max_loras: int, sorted_token_ids, slot_starts) -> None:
    """The index tensors' dtypes and sizes (their contents are not read: that would sync)."""
    for name, t, size in (("sorted_token_ids", sorted_token_ids, num_tokens),
                          ("slot_starts", slot_starts, max_loras + 1)):
        _check_tensor(name, t, 1, (torch.int32,))
        if t.shape[0] != size or not t.is_contiguous():
            _fail(f"{name} must be contiguous with {size} entries; got shape {tuple(t.shape)}, "
                  f"strides {t.stride()}")


def check_lora_shrink(x, lora_a, sorted_token_ids, slot_starts) -> None:
    _check_tensor("x", x, 2, FLOAT_DTYPES)
    _check_tensor("lora_a", lora_a, 3, FLOAT_DTYPES)
    if lora_a.dtype != x.dtype:
        _fail(f"lora_a dtype {lora_a.dtype} != x dtype {x.dtype}")
    if lora_a.shape[2] != x.shape[1]:
        _fail(f"lora_a [max_loras, N, K] = {tuple(lora_a.shape)} does not match x [num_tokens, K] = {tuple(x.shape)}")
    check_lora_mapping(x.shape[0], lora_a.shape[0], sorted_token_ids, slot_starts)
    for name, t in (("lora_a", lora_a), ("sorted_token_ids", sorted_token_ids), ("slot_starts", slot_starts)):
        if t.device != x.device:
            _fail(f"{name} is on {t.device} but x is on {x.device}")


def check_lora_expand(buf, lora_b, y, sorted_token_ids, slot_starts, part_offsets) -> None:
    _check_tensor("buf", buf, 3, (torch.float32,))
    _check_tensor("lora_b", lora_b, 3, FLOAT_DTYPES)
    _check_tensor("y", y, 2, FLOAT_DTYPES)
    _check_tensor("part_offsets", part_offsets, 1, (torch.int32,))
    num_parts = part_offsets.shape[0] - 1
    if not 1 <= num_parts <= 8 or not part_offsets.is_contiguous():
        _fail(f"part_offsets must be contiguous [num_parts + 1] with 1 <= num_parts <= 8; "
              f"got shape {tuple(part_offsets.shape)}")
    if lora_b.shape[2] % num_parts:
        _fail(f"lora_b [max_loras, out, N] = {tuple(lora_b.shape)}: N is not a multiple of {num_parts} parts")
    if y.dtype != lora_b.dtype:
        _fail(f"y dtype {y.dtype} != lora_b dtype {lora_b.dtype}")
    if y.shape[1] != lora_b.shape[1]:
        _fail(f"y [num_tokens, out] = {tuple(y.shape)} does not match lora_b [max_loras, out, N] = "
              f"{tuple(lora_b.shape)}")
    if buf.shape[1:] != (y.shape[0], lora_b.shape[2]) or buf.stride(2) != 1:
        _fail(f"buf must be [split_k, num_tokens, N] = [*, {y.shape[0]}, {lora_b.shape[2]}] with unit "
              f"last stride; got shape {tuple(buf.shape)}, strides {buf.stride()}")
    check_lora_mapping(y.shape[0], lora_b.shape[0], sorted_token_ids, slot_starts)
    for name, t in (("buf", buf), ("lora_b", lora_b), ("sorted_token_ids", sorted_token_ids),
                    ("slot_starts", slot_starts), ("part_offsets", part_offsets)):
        if t.device != y.device:
            _fail(f"{name} is on {t.device} but y is on {y.device}")


