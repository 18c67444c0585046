"""Vocab-parallel token embedding and LM head.

The vocabulary is split into tp_size equal shards of ceil(vocab / tp_size) rows;
the last shard is zero-padded so every rank's weight has the same shape (which
all_gather needs). Rank r owns token ids [r * shard, r * shard + shard).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.executor.parallel_state import (get_tp_rank, get_tp_size, tensor_model_parallel_all_gather,
                                tensor_model_parallel_all_reduce)
from engine.layers.cpu_gemm import packed_linear
from engine.layers.linear import copy_weight
from engine.math_utils import cdiv


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.num_embeddings = num_embeddings
        self.shard_size = cdiv(num_embeddings, self.tp_size)
        self.vocab_start = self.tp_rank * self.shard_size
        self.vocab_end = min(self.vocab_start + self.shard_size, num_embeddings)
        # [shard_size, embedding_dim]; rows past vocab_end are padding
        self.weight = nn.Parameter(torch.empty(self.shard_size, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        if loaded_weight.shape[0] != self.num_embeddings:
            raise ValueError(f"checkpoint vocab has {loaded_weight.shape[0]} rows, config says {self.num_embeddings}")
        num_rows = self.vocab_end - self.vocab_start
        copy_weight(param.data[:num_rows], loaded_weight.narrow(0, self.vocab_start, num_rows))
        param.data[num_rows:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids [num_tokens] -> [num_tokens, embedding_dim]
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        # Ids outside this rank's shard read row 0 and are zeroed; the all_reduce
        # then fills each row from the one rank that owns its id.
        in_shard = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = (input_ids - self.vocab_start) * in_shard
        y = F.embedding(local_ids, self.weight)
        y.masked_fill_(~in_shard.unsqueeze(1), 0)
        return tensor_model_parallel_all_reduce(y)


class ParallelLMHead(VocabParallelEmbedding):
    """Hidden states -> logits over the full vocabulary. Tie it to the embedding by
    assigning `lm_head.weight = embed_tokens.weight` (same shard layout)."""

    # CPU fp32, untied: the weight packed for oneDNN after loading (engine.layers.cpu_gemm).
    packed_weight: torch.Tensor | None = None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # [n, hidden] -> [n, shard_size] -> all_gather -> [n, shard_size * tp_size] -> [n, vocab]
        if self.packed_weight is not None:
            logits = packed_linear(hidden_states, self.packed_weight, None)
        else:
            logits = F.linear(hidden_states, self.weight)
        if self.tp_size == 1:
            return logits
        logits = tensor_model_parallel_all_gather(logits, dim=-1)
        return logits[:, : self.num_embeddings]
