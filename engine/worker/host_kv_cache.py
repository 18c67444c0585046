"""The host tier of the KV cache: copies of evicted prefix blocks, in host memory (`kv_offload_gb`).

The block manager decides what moves (engine/core/kv_offload.py); this executes each step's plan
before the step's forward, on every TP rank (each copies its own shard with the same block ids):

    blocks_to_swap_out  [(device block, host block)]   device -> host, first
    blocks_to_swap_in   [(host block, device block)]   host -> device, then

Layout: one tensor of words, a host block contiguous across layers so that one block is one copy:

    host blocks  [num_host_blocks, num_layers, 2 (K, V), block_words]   int64
    a layer's K  [num_blocks, block_size, num_kv_heads, head_dim] -> viewed [num_blocks, block_words]

Bits, not values: any KV dtype (fp8 included) copies alike. Words rather than bytes because
torch's CPU index_select / index_copy_ take a memcpy path for 8-byte rows, and go element by
element for bytes. On CUDA the copies run on a stream
of their own, after whatever the compute stream had queued (a block being evicted may still be
written by the step in flight), and the compute stream waits for them before the forward: the
host never waits (`cudaStreamWaitEvent`), and the host memory is pinned so the copies are
asynchronous. Pinned with cudaHostRegister on a plain allocation: `pin_memory=True` goes through
PyTorch's caching host allocator, which rounds a size up to a power of two (up to 2x the budget).
On CPU the "device" cache is host memory already; the copies are plain indexed copies.
"""
from __future__ import annotations

import weakref

import torch

from engine.worker.forward_context import to_device
from engine.worker.kv_cache import allocate_kv_tensor

# Blocks gathered into one device staging buffer at a time (at most this many blocks' bytes of
# every layer): bounds the transient device memory a large swap-in needs.
MAX_STAGING_BYTES = 64 * 2**20


class HostKVCache:
    """The host blocks of one rank and the copies between them and the attention layers' caches."""

    def __init__(self, attn_layers: list, num_host_blocks: int, device: torch.device):
        # [num_blocks, block_words] views of every layer's K and V cache: the copies' unit.
        self.device_blocks = [(_as_blocks(a.k_cache), _as_blocks(a.v_cache)) for a in attn_layers]
        widths = {(t.shape[1], t.dtype) for kv in self.device_blocks for t in kv}
        assert len(widths) == 1, f"every layer's block must have one size to offload, got {widths}"
        block_words, word = widths.pop()
        self.num_host_blocks = num_host_blocks
        self.device = device
        shape = (num_host_blocks, len(attn_layers), 2, block_words)
        self.blocks = allocate_kv_tensor(shape, word, torch.device("cpu"))
        if device.type == "cuda":
            _pin(self.blocks)
            self.stream = torch.cuda.Stream(device)

    def swap(self, blocks_to_swap_out: list[tuple[int, int]], blocks_to_swap_in: list[tuple[int, int]]) -> None:
        """Run one step's copies, out before in (a block evicted and refilled in one step is read first)."""
        if self.device.type != "cuda":
            self._swap_out_cpu(blocks_to_swap_out)
            self._swap_in_cpu(blocks_to_swap_in)
            return
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.stream):
            self.stream.wait_stream(compute)  # after every write queued so far (the step in flight)
            for chunk in _chunks(blocks_to_swap_out, self._staging_blocks):
                self._swap_out_cuda(chunk)
            for chunk in _chunks(blocks_to_swap_in, self._staging_blocks):
                self._swap_in_cuda(chunk)
        compute.wait_stream(self.stream)  # the forward reads (and overwrites) these blocks

    @property
    def block_bytes(self) -> int:
        """Bytes of one host block: every layer's K and V."""
        return self.blocks[0].numel() * self.blocks.element_size()

    @property
    def _staging_blocks(self) -> int:
        return max(1, MAX_STAGING_BYTES // self.block_bytes)

    def _swap_out_cpu(self, pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        src = torch.tensor([d for d, _ in pairs])
        dst = torch.tensor([h for _, h in pairs])
        for layer, kv in enumerate(self.device_blocks):
            for i, t in enumerate(kv):
                self.blocks[:, layer, i].index_copy_(0, dst, torch.index_select(t, 0, src))

    def _swap_in_cpu(self, pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        src = torch.tensor([h for h, _ in pairs])
        dst = torch.tensor([d for _, d in pairs])
        for layer, kv in enumerate(self.device_blocks):
            for i, t in enumerate(kv):
                t.index_copy_(0, dst, torch.index_select(self.blocks[:, layer, i], 0, src))

    def _swap_out_cuda(self, pairs: list[tuple[int, int]]) -> None:
        """Gather the blocks of every layer into one staging buffer on the device, then copy it to
        the host blocks: one copy per run of consecutive host ids."""
        src = to_device([d for d, _ in pairs], torch.long, self.device)
        staging = torch.empty((len(pairs),) + self.blocks.shape[1:], dtype=self.blocks.dtype, device=self.device)
        for layer, kv in enumerate(self.device_blocks):
            for i, t in enumerate(kv):
                staging[:, layer, i] = torch.index_select(t, 0, src)
        for start, host_id, n in _runs([h for _, h in pairs]):
            self.blocks[host_id:host_id + n].copy_(staging[start:start + n], non_blocking=True)

    def _swap_in_cuda(self, pairs: list[tuple[int, int]]) -> None:
        staging = torch.empty((len(pairs),) + self.blocks.shape[1:], dtype=self.blocks.dtype, device=self.device)
        for start, host_id, n in _runs([h for h, _ in pairs]):
            staging[start:start + n].copy_(self.blocks[host_id:host_id + n], non_blocking=True)
        dst = to_device([d for _, d in pairs], torch.long, self.device)
        for layer, kv in enumerate(self.device_blocks):
            for i, t in enumerate(kv):
                t.index_copy_(0, dst, staging[:, layer, i])


def host_kv_blocks(kv_offload_gb: float, tp_size: int, bytes_per_block: int) -> int:
    """Host blocks one rank holds: its share of the engine's `kv_offload_gb`, in whole blocks of
    every layer's K and V (`bytes_per_block` of this rank's shard)."""
    return int(kv_offload_gb * 2**30 / tp_size) // bytes_per_block


def _as_blocks(cache: torch.Tensor) -> torch.Tensor:
    """[num_blocks, block_size, heads, head_dim] of any dtype -> [num_blocks, block_words] int64, the
    same memory (a block's bytes are a multiple of 8: EngineConfig keeps block_size one)."""
    rows = cache.view(cache.shape[0], -1).view(torch.uint8)
    assert rows.shape[1] % 8 == 0, f"a KV block of {rows.shape[1]} bytes is not whole 8-byte words"
    return rows.view(torch.int64)


def _chunks(pairs: list, size: int):
    for i in range(0, len(pairs), size):
        yield pairs[i:i + size]


def _runs(host_ids: list[int]) -> list[tuple[int, int, int]]:
    """(first index, first host id, length) of each run of consecutive host ids, in order:

        host ids [7, 8, 9, 2, 3] -> [(0, 7, 3), (3, 2, 2)]
    """
    runs: list[tuple[int, int, int]] = []
    for i, h in enumerate(host_ids):
        if runs and runs[-1][1] + runs[-1][2] == h:
            start, first, n = runs[-1]
            runs[-1] = (start, first, n + 1)
        else:
            runs.append((i, h, 1))
    return runs


def _pin(t: torch.Tensor) -> None:
    """Page-lock `t`'s memory for asynchronous copies, exactly its size; unregistered when `t` goes."""
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
    if int(getattr(err, "value", err)) != 0:
        raise RuntimeError(f"cudaHostRegister of {t.numel() * t.element_size()} bytes for the host KV tier "
                           f"failed ({err}); lower kv_offload_gb")
    weakref.finalize(t, cudart.cudaHostUnregister, t.data_ptr())
