"""logit_bias, allowed_token_ids and bad_words: a request's own edits of its logits, batched.

The Sampler applies them in vLLM V1's order, after the raw logprobs are taken (so, as vLLM's
default `logprobs_mode="raw_logprobs"` does, logprobs report the model's distribution under the
grammar, not these edits) and before the penalties:

    allowed_token_ids -> bad_words -> min_tokens -> logit_bias -> penalties

Each is one tensor op per step over the rows that use it. Python loops over those rows only
(and over a row's bad words), never over the vocabulary; the id and bias tensors of a request
are built once, on the logits' device, and kept per sequence until `free`.

A request's edits never empty its row: where allowed_token_ids or bad_words (with min_tokens)
ban every token the grammar left, the row falls back to the grammar's logits for that step
(`RowGuard`), since a row of -inf only has garbage to sample, and a grammar would refuse it.
"""
from __future__ import annotations

import torch

from engine.core.sequence import Sequence
from engine.worker.forward_context import to_device


class TokenControls:
    """Per-sequence device tensors of allowed_token_ids and logit_bias, made on first use."""

    def __init__(self):
        self._allowed: dict[int, torch.Tensor] = {}  # seq_id -> int64 [num_allowed]
        self._bias: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # seq_id -> (int64 ids, float32 biases)

    def free(self, seq_id: int) -> None:
        self._allowed.pop(seq_id, None)
        self._bias.pop(seq_id, None)

    def apply_allowed_token_ids(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """-inf (in place) on every token outside each row's allowed_token_ids."""
        rows = [i for i, s in enumerate(seqs) if s.sampling_params.allowed_token_ids]
        if not rows:
            return
        banned = torch.ones(len(rows), logits.shape[1], dtype=torch.bool, device=logits.device)
        for r, i in enumerate(rows):
            banned[r].index_fill_(0, self._allowed_ids(seqs[i], logits.device), False)
        _update_rows(logits, rows, lambda x: x.masked_fill_(banned, float("-inf")))

    def apply_logit_bias(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """logits[row, token] += bias (in place) for each row's logit_bias."""
        rows = [i for i, s in enumerate(seqs) if s.sampling_params.logit_bias]
        if not rows:
            return
        vocab = logits.shape[1]
        flat, biases = [], []  # into the flattened logits: row * vocab + token
        for i in rows:
            ids, values = self._bias_of(seqs[i], logits.device)
            flat.append(ids + i * vocab)
            biases.append(values)
        logits.view(-1).index_add_(0, torch.cat(flat), torch.cat(biases))

    def _allowed_ids(self, seq: Sequence, device: torch.device) -> torch.Tensor:
        ids = self._allowed.get(seq.seq_id)
        if ids is None:
            ids = self._allowed[seq.seq_id] = to_device(seq.sampling_params.allowed_token_ids, torch.int64, device)
        return ids

    def _bias_of(self, seq: Sequence, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        entry = self._bias.get(seq.seq_id)
        if entry is None:
            bias = seq.sampling_params.logit_bias
            entry = self._bias[seq.seq_id] = (to_device(list(bias), torch.int64, device),
                                              to_device(list(bias.values()), torch.float32, device))
        return entry


def apply_bad_words(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """-inf (in place) on the last token of each bad word whose earlier tokens end the output
    so far (vLLM's rule: a one-token word is always banned; the prompt does not count)."""
    vocab = logits.shape[1]
    flat: list[int] = []
    for i, seq in enumerate(seqs):
        if not seq.bad_words_token_ids:
            continue
        tokens, num_output = seq.token_ids, seq.num_output_tokens
        for word in seq.bad_words_token_ids:
            prefix_len = len(word) - 1
            if prefix_len > num_output:
                continue
            if prefix_len == 0 or tokens[len(tokens) - prefix_len:] == word[:-1]:
                flat.append(i * vocab + word[-1])
    if flat:
        logits.view(-1).index_fill_(0, to_device(flat, torch.int64, logits.device), float("-inf"))


class RowGuard:
    """Keeps the logits of the rows that ban tokens, so that a row they emptied can be restored."""

    def __init__(self, logits: torch.Tensor, seqs: list[Sequence]):
        self.rows = [i for i, s in enumerate(seqs) if s.sampling_params.allowed_token_ids or s.bad_words_token_ids]
        self._index = to_device(self.rows, torch.int64, logits.device) if self.rows else None
        self._before = logits.index_select(0, self._index) if self.rows else None  # [num_rows, vocab]

    def restore_emptied(self, logits: torch.Tensor) -> None:
        """Rows left with no finite logit get their saved logits back (no host sync)."""
        if not self.rows:
            return
        after = logits.index_select(0, self._index)
        emptied = torch.isneginf(after).all(dim=1, keepdim=True)  # [num_rows, 1]
        logits.index_copy_(0, self._index, torch.where(emptied, self._before, after))


def _update_rows(logits: torch.Tensor, rows: list[int], edit) -> None:
    """Apply `edit` (in place, on a [len(rows), vocab] tensor) to those rows of logits."""
    if len(rows) == logits.shape[0]:
        edit(logits)
        return
    index = to_device(rows, torch.int64, logits.device)
    logits.index_copy_(0, index, edit(logits.index_select(0, index)))
