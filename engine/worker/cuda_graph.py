"""CUDA graphs for decode steps: one captured graph per padded batch size.

A decode step (one new token per sequence) has shapes that depend only on the
batch size, so it can be replayed from static buffers. Each step's inputs are
copied into the first `n` rows of those buffers; rows n..bs are padding that
writes nothing (slot -1) and attends to one cached token of block 0.

    static buffers (max_bs rows)       captured graphs (share one memory pool)
    input_ids/positions/slot_mapping   bs = 1, 2, 4, 8, 16, 32, ... max_num_seqs
    seq_lens / block_tables            replay the smallest bs >= n, read hidden[:n]
    LoRA: sorted rows / slot starts

With LoRA, every graph captures the adapters' Triton kernels (engine/layers/lora.py) reading the
step's rows grouped by slot from two more static buffers; a step without adapters marks every
slot empty (its kernels' programs exit at once), and padding rows are in no slot.
"""
from __future__ import annotations

import logging

import torch

from engine.worker.forward_context import AttentionMetadata, LoRAKernelMapping, set_forward_context
from engine.math_utils import cdiv
from engine.core.messages import ModelInput

logger = logging.getLogger(__name__)


def capture_batch_sizes(max_num_seqs: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sorted(set(sizes + [max_num_seqs]))


class CUDAGraphRunner:
    def __init__(self, model: torch.nn.Module, max_num_seqs: int, max_model_len: int, block_size: int,
                 device: torch.device, num_kv_groups: int = 1, max_loras: int = 0):
        self.model = model
        self.batch_sizes = capture_batch_sizes(max_num_seqs)
        self.max_bs = self.batch_sizes[-1]
        self.max_model_len = max_model_len
        max_blocks = cdiv(max_model_len, block_size)
        kw = dict(device=device)
        self.input_ids = torch.zeros(self.max_bs, dtype=torch.long, **kw)       # [max_bs]
        self.positions = torch.zeros(self.max_bs, dtype=torch.long, **kw)       # [max_bs]
        self.slot_mapping = torch.full((self.max_bs,), -1, dtype=torch.long, **kw)  # [max_bs]
        self.seq_lens = torch.ones(self.max_bs, dtype=torch.int32, **kw)        # [max_bs]
        self.block_tables = torch.zeros(self.max_bs, max_blocks, dtype=torch.int32, **kw)
        self.cu_seqlens_q = torch.arange(self.max_bs + 1, dtype=torch.int32, **kw)  # one row per seq
        # The same two buffers for each KV cache group after the first (the sliding layers' pool).
        self.group_slot_mappings = [torch.full_like(self.slot_mapping, -1) for _ in range(num_kv_groups - 1)]
        self.group_block_tables = [torch.zeros_like(self.block_tables) for _ in range(num_kv_groups - 1)]
        # With LoRA (max_loras > 0): kernels/lora_mapping.py's sorted rows and slot starts.
        self.lora_sorted_ids = torch.zeros(self.max_bs, dtype=torch.int32, **kw) if max_loras else None
        self.lora_slot_starts = torch.zeros(max_loras + 1, dtype=torch.int32, **kw) if max_loras else None
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # bs -> hidden [bs, hidden_size], owned by the graph

    def _metadata(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(slot_mapping=self.slot_mapping[:bs], block_tables=self.block_tables[:bs],
                                 seq_lens=self.seq_lens[:bs], cu_seqlens_q=self.cu_seqlens_q[:bs + 1],
                                 max_seqlen_q=1, max_seqlen_k=self.max_model_len,
                                 group_slot_mappings=[s[:bs] for s in self.group_slot_mappings],
                                 group_block_tables=[t[:bs] for t in self.group_block_tables])

    def _lora_mapping(self, bs: int) -> LoRAKernelMapping | None:
        if self.lora_slot_starts is None:
            return None
        return LoRAKernelMapping(self.lora_sorted_ids[:bs], self.lora_slot_starts)

    @torch.inference_mode()
    def capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        # Largest first: later (smaller) graphs fit in the memory the first one reserved.
        for bs in reversed(self.batch_sizes):
            with set_forward_context(self._metadata(bs), self._lora_mapping(bs)):
                self.model(self.input_ids[:bs], self.positions[:bs])  # warm-up: compile kernels, no capture
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[bs] = self.model(self.input_ids[:bs], self.positions[:bs])
            self.graphs[bs] = graph
        torch.cuda.synchronize()
        logger.info("captured %d decode CUDA graphs (batch sizes up to %d)", len(self.graphs), self.max_bs)

    def can_run(self, mi: ModelInput) -> bool:
        return len(mi.query_lens) <= self.max_bs and all(q == 1 for q in mi.query_lens)

    def run(self, mi: ModelInput, input_ids: torch.Tensor,
            lora_rows: tuple[list[int], list[int]] | None = None) -> torch.Tensor:
        """Replay the graph for this decode step; returns hidden [n, hidden_size] (a view: use before next run).

        input_ids: [n] on the device (some rows may come from the previous step's sampled tokens).
        lora_rows: with LoRA, the step's (sorted_token_ids [n], slot_starts [max_loras + 1]) host lists."""
        bs = self.prepare_replay(mi, input_ids, lora_rows)
        self.graphs[bs].replay()
        return self.outputs[bs][:len(mi.input_ids)]

    def prepare_replay(self, mi: ModelInput, input_ids: torch.Tensor,
                       lora_rows: tuple[list[int], list[int]] | None = None) -> int:
        """Copy the step into the static buffers; the batch size of the graph to replay."""
        n = len(mi.input_ids)
        bs = next(b for b in self.batch_sizes if b >= n)
        width = len(mi.block_tables[0])
        self.input_ids[:n].copy_(input_ids)
        _copy_from_host(self.positions[:n], mi.positions)
        _copy_from_host(self.slot_mapping[:n], mi.slot_mapping)
        _copy_from_host(self.seq_lens[:n], mi.seq_lens)
        _copy_from_host(self.block_tables[:n, :width], mi.block_tables)
        for slots, tables, mi_slots, mi_tables in zip(self.group_slot_mappings, self.group_block_tables,
                                                      mi.group_slot_mappings, mi.group_block_tables):
            _copy_from_host(slots[:n], mi_slots)
            _copy_from_host(tables[:n, :width], mi_tables)
        if bs > n:  # padding rows: write nothing, attend to one harmless cached token
            for slots, tables in zip([self.slot_mapping, *self.group_slot_mappings],
                                     [self.block_tables, *self.group_block_tables]):
                slots[n:bs].fill_(-1)
                tables[n:bs, 0].fill_(0)
            self.seq_lens[n:bs].fill_(1)
        if self.lora_slot_starts is not None:
            # Rows n..bs stay stale: they lie past slot_starts[-1] <= n, in no slot.
            sorted_ids, starts = lora_rows
            _copy_from_host(self.lora_sorted_ids[:n], sorted_ids)
            _copy_from_host(self.lora_slot_starts, starts)
        return bs


def _copy_from_host(dst: torch.Tensor, values: list) -> None:
    """dst := values (a host list), in dst's dtype; on CUDA from pinned memory without a sync, which
    the replay, later in the same stream, reads in order."""
    host = torch.tensor(values, dtype=dst.dtype)
    if dst.is_cuda:
        host = host.pin_memory()
    dst.copy_(host, non_blocking=True)
