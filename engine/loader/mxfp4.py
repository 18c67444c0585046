"""MXFP4 (OCP microscaling FP4) checkpoint tensors, dequantized at load.

A weight `X` of shape [..., N] is stored as two tensors:

    X_blocks [..., N / 32, 16] uint8   two E2M1 values a byte, the low nibble first
    X_scales [..., N / 32]     uint8   one E8M0 exponent per block of 32: 2 ** (s - 127)

    byte b of block g:  X[..., 32 g + 2 b] = E2M1[b & 0xF],  X[..., 32 g + 2 b + 1] = E2M1[b >> 4]
    every value of block g times 2 ** (scale[g] - 127)

E2M1 is 1 sign, 2 exponent and 1 mantissa bit: the 16 codes below. Products of a code and a
power of two are exact in bfloat16 and float32, so dequantizing loses nothing. Until the
quantization work keeps the experts packed, gpt-oss's MXFP4 checkpoints are dequantized to the
model dtype here (4.25 bits a weight on disk, 16 in memory).
"""
from __future__ import annotations

import torch

# code -> value: 0b0000..0b0111 positive, the sign bit (0b1000) negates.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK_SIZE = 32  # values sharing one scale
_BLOCKS, _SCALES = "_blocks", "_scales"
_CHUNK_VALUES = 1 << 24  # 64 MiB of float32 a step


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks [..., G, 16] uint8 and scales [..., G] uint8 -> [..., G * 32] in `dtype`.

    Runs _CHUNK_VALUES values at a time, so the float32 temporaries stay a slice of the result."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 2 or blocks.shape[-1] != BLOCK_SIZE // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} are not "
                         f"[..., G, {BLOCK_SIZE // 2}] and [..., G]")
    out = torch.empty(*scales.shape[:-1], scales.shape[-1] * BLOCK_SIZE, dtype=dtype)
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    flat_blocks, flat_scales = blocks.reshape(-1, *blocks.shape[-2:]), scales.reshape(-1, scales.shape[-1])
    flat_out = out.view(-1, out.shape[-1])
    step = max(1, _CHUNK_VALUES // out.shape[-1])  # rows a chunk
    for start in range(0, flat_blocks.shape[0], step):
        blk = flat_blocks[start:start + step].long()  # [rows, G, 16]
        values = torch.stack((lut[blk & 0xF], lut[blk >> 4]), dim=-1).flatten(-2)  # [rows, G, 32]
        exponent = flat_scales[start:start + step].to(torch.int32) - 127
        flat_out[start:start + step] = torch.ldexp(values, exponent.unsqueeze(-1).float()).flatten(-2)
    return out


def dequantized_stream(tensors, dtype: torch.dtype):
    """A checkpoint stream of (file name, name, tensor thunk) with every `X_blocks` / `X_scales`
    pair replaced by one entry (the blocks' file name, `X`, a thunk of the dequantized tensor).

    The pair's two tensors are read as they come (a thunk is only valid while its file is
    open), and may come in either order or from different files; other entries pass through."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for file_name, name, tensor in tensors:
        suffix = name[-len(_BLOCKS):] if name else None
        if suffix not in (_BLOCKS, _SCALES):
            yield file_name, name, tensor
            continue
        base = name[:-len(suffix)]
        pair = pending.setdefault(base, {})
        pair[suffix] = tensor()
        if len(pair) == 2:
            del pending[base]
            yield (f"{base}{_BLOCKS}", base,
                   lambda pair=pair: dequantize_mxfp4(pair[_BLOCKS], pair[_SCALES], dtype))
    for base, pair in pending.items():  # half a pair: the loader names it as unexpected
        (suffix,) = pair
        yield f"{base}{suffix}", f"{base}{suffix}", lambda t=pair[suffix]: t
