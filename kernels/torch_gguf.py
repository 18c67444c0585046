"""GGUF quantized blocks in plain torch: the layouts, a dequantizer, and y = x @ W.T tile by tile.

The reference for kernels/cpu_gguf.c and kernels/triton_gguf_gemm.py, and the path wherever
neither runs (no C compiler, a CUDA type the Triton kernel lacks). A weight is its GGUF rows
kept as stored, `uint8 [out_features, in_features / block_elems * block_bytes]`: output row o
is the concatenated blocks of W[o, :]. Layouts (ggml-common.h; d, dmin are fp16):

    Q8_0  32 elems, 34 B:  d | int8 q[32]                       w = d * q
    Q4_0  32 elems, 18 B:  d | qs[16]                           w = d * (q - 8)
    Q4_1  32 elems, 20 B:  d | m | qs[16]                       w = d * q + m
    Q5_0  32 elems, 22 B:  d | qh[4] | qs[16]                   w = d * (q - 16)
    Q5_1  32 elems, 24 B:  d | m | qh[4] | qs[16]               w = d * q + m
    Q4_K 256 elems, 144 B: d | dmin | scales[12] | qs[128]      8 sub-blocks of 32, each with a 6-bit
                                                                scale sc and min m: w = d*sc*q - dmin*m
    Q5_K 256 elems, 176 B: d | dmin | scales[12] | qh[32] | qs[128]   as Q4_K, q gets a 5th bit from qh
    Q6_K 256 elems, 210 B: ql[128] | qh[64] | int8 scales[16] | d     16 sub-blocks of 16: w = d*sc*(q-32)

In the four 32-element types with nibbles (m is fp16 too), element j's 4 low bits are the low
nibble of qs[j] for j < 16 and the high nibble of qs[j - 16] for j >= 16; Q5_0 / Q5_1 take the
5th bit from bit j of qh read as a little-endian uint32 (bit j % 8 of qh[j // 8]).

Sub-block s (32 elements) of Q4_K / Q5_K reads the nibbles of qs[32*(s//2) : +32] (low for even s,
high for odd) and bit s of qh[l]. In Q6_K, element k = 128*h + 32*t + l takes ql[64h + 32(t%2) + l]
shifted by 4*(t//2), qh[32h + l] shifted by 2t, and scale k // 16.
"""
from __future__ import annotations

import torch

# ggml's type ids (GGMLQuantizationType) -> (elements per block, bytes per block).
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K = 2, 3, 6, 7, 8, 12, 13, 14
BLOCK_LAYOUTS = {Q4_0: (32, 18), Q4_1: (32, 20), Q5_0: (32, 22), Q5_1: (32, 24), Q8_0: (32, 34),
                 Q4_K: (256, 144), Q5_K: (256, 176), Q6_K: (256, 210)}
TYPE_NAMES = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q5_0: "Q5_0", Q5_1: "Q5_1", Q8_0: "Q8_0", Q4_K: "Q4_K", Q5_K: "Q5_K",
              Q6_K: "Q6_K"}
# The 32-element types with nibbles: qtype -> (has an fp16 min m, has 4 bytes of 5th bits).
_LEGACY_NIBBLES = {Q4_0: (False, False), Q4_1: (True, False), Q5_0: (False, True), Q5_1: (True, True)}
# Rows of W dequantized at a time by `gguf_linear_ref`: a tile of fp32 rows, never the whole matrix.
TILE_ROWS = 256


def check_weight(weight: torch.Tensor, qtype: int, in_features: int) -> None:
    """ValueError unless `weight` is uint8 [out, in_features / block * bytes] rows of `qtype` blocks."""
    if qtype not in BLOCK_LAYOUTS:
        raise ValueError(f"GGUF type id {qtype} has no packed kernel (supported: {', '.join(TYPE_NAMES.values())})")
    elems, nbytes = BLOCK_LAYOUTS[qtype]
    if in_features % elems:
        raise ValueError(f"in_features={in_features} is not a multiple of {TYPE_NAMES[qtype]}'s block of {elems}")
    if weight.dtype != torch.uint8 or weight.dim() != 2 or weight.shape[1] != in_features // elems * nbytes:
        raise ValueError(f"{TYPE_NAMES[qtype]} weight must be uint8 [out, {in_features // elems * nbytes}], "
                         f"got {weight.dtype} {tuple(weight.shape)}")


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] little-endian bytes -> fp32 [..., 1]."""
    return b.contiguous().view(torch.float16).float()


def _k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 scale bytes [n, 12] -> 6-bit scales and mins [n, 8]: bytes 0-3 hold
    sc[0:4] (low 6 bits) and sc[4:8]'s top 2 bits; 4-7 the same for the mins; 8-11 sc[4:8]'s
    low nibble and m[4:8]'s high nibble."""
    s = scales.long()
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([d & 63, (md & 15) | ((d >> 6) << 4)], dim=1)
    mn = torch.cat([m & 63, (md >> 4) | ((m >> 6) << 4)], dim=1)
    return sc.float(), mn.float()


def _nibbles_32(qs: torch.Tensor) -> torch.Tensor:
    """[n, 128] bytes -> [n, 8, 32] nibbles: sub-block s is qs[32*(s//2):+32] >> 4*(s%2)."""
    q = qs.long().view(-1, 4, 1, 32) >> torch.tensor([0, 4], device=qs.device).view(1, 1, 2, 1)
    return (q & 15).view(-1, 8, 32)


def _legacy_nibbles(blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    """Q4_0 / Q4_1 / Q5_0 / Q5_1 blocks [n, bytes] -> [n, 32] fp32 (d | (m) | (qh[4]) | qs[16])."""
    has_min, five_bit = _LEGACY_NIBBLES[qtype]
    qs = blocks[:, -16:].long()
    q = torch.cat([qs & 15, qs >> 4], dim=1)
    if five_bit:  # bit j % 8 of qh[j // 8] is element j's 5th bit
        qh = blocks[:, -20:-16].long().view(-1, 4, 1) >> torch.arange(8, device=blocks.device).view(1, 1, 8)
        q = q | ((qh & 1) << 4).view(-1, 32)
    d = _f16(blocks[:, :2])
    if has_min:
        return d * q.float() + _f16(blocks[:, 2:4])
    return d * (q - (16 if five_bit else 8)).float()


def dequantize_blocks(blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    """[n, bytes per block] uint8 -> [n, elems per block] fp32."""
    if qtype == Q8_0:
        return _f16(blocks[:, :2]) * blocks[:, 2:].contiguous().view(torch.int8).float()
    if qtype in _LEGACY_NIBBLES:
        return _legacy_nibbles(blocks, qtype)
    if qtype in (Q4_K, Q5_K):
        d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
        sc, mn = _k_scales(blocks[:, 4:16])
        q = _nibbles_32(blocks[:, -128:])
        if qtype == Q5_K:  # bit s of qh[l] is the 5th bit of sub-block s's element l
            bits = blocks[:, 16:48].long().view(-1, 1, 32) >> torch.arange(8, device=blocks.device).view(1, 8, 1)
            q = q | ((bits & 1) << 4)
        return ((d * sc)[:, :, None] * q.float() - (dmin * mn)[:, :, None]).view(-1, 256)
    if qtype == Q6_K:
        ql = blocks[:, :128].long().view(-1, 2, 1, 64) >> torch.tensor([0, 4], device=blocks.device).view(1, 1, 2, 1)
        ql = (ql & 15).view(-1, 2, 4, 32)
        qh = blocks[:, 128:192].long().view(-1, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], device=blocks.device).view(1, 1, 4, 1)
        q = (ql | ((qh & 3) << 4)).view(-1, 16, 16) - 32
        scale = _f16(blocks[:, 208:210]) * blocks[:, 192:208].contiguous().view(torch.int8).float()
        return (scale[:, :, None] * q.float()).view(-1, 256)
    raise ValueError(f"GGUF type id {qtype} has no torch dequantizer (supported: {', '.join(TYPE_NAMES.values())})")


def dequantize(weight: torch.Tensor, qtype: int) -> torch.Tensor:
    """uint8 rows [out, row_bytes] -> fp32 [out, in_features]."""
    elems, nbytes = BLOCK_LAYOUTS[qtype]
    rows = weight.shape[0]
    return dequantize_blocks(weight.reshape(-1, nbytes), qtype).view(rows, -1)


def gguf_linear_ref(x: torch.Tensor, weight: torch.Tensor, qtype: int) -> torch.Tensor:
    """x [n, in] @ dequantize(weight).T -> [n, out] in x's dtype, TILE_ROWS rows of W at a time
    (fp32 accumulation), so the dequantized matrix never exists whole."""
    check_weight(weight, qtype, x.shape[-1])
    xf = x.float()
    out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32, device=x.device)
    for o in range(0, weight.shape[0], TILE_ROWS):
        out[:, o:o + TILE_ROWS] = xf @ dequantize(weight[o:o + TILE_ROWS], qtype).T
    return out.to(x.dtype)
