"""Prompt-lookup (n-gram) proposals: what followed the last n tokens the previous time they occurred.

    tokens:  ... a b c d e ... x y a b c          last n = 3 tokens "a b c" occurred earlier;
                 ^^^^^ ------                     propose what followed: d e ... (up to k tokens)

The longest n in [min_n, max_n] with an earlier occurrence wins, and among its occurrences the
earliest (vLLM's and HF `prompt_lookup_num_tokens`' rule). Numpy over the sequence's tokens: one
vectorised scan for the occurrences of the last token, then at most max_n - 1 vectorised
comparisons that extend those candidates backwards; no loop over tokens. No torch.

Each sequence's tokens live in a numpy buffer that grows with it (tokens are append-only while it
runs), so a step converts only its new tokens.
"""
from __future__ import annotations

import numpy as np

from engine.core.sequence import Sequence


def find_draft(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """Up to k tokens that followed the earliest earlier occurrence of the longest suffix of
    `tokens` of length n in [min_n, max_n]; empty when there is none."""
    num_tokens = len(tokens)
    if num_tokens < min_n + 1 or k < 1:
        return tokens[:0]
    # Candidate match ends: earlier positions holding the last token, with a token after them.
    ends = np.flatnonzero(tokens[:num_tokens - 1] == tokens[num_tokens - 1])
    if len(ends) == 0:
        return tokens[:0]
    match_len = np.ones(len(ends), dtype=np.int64)
    alive = np.ones(len(ends), dtype=bool)
    for i in range(1, max_n):  # extend every live candidate one token further back
        alive &= ends >= i
        idx = np.flatnonzero(alive)
        if len(idx) == 0:
            break
        alive[idx] = tokens[ends[idx] - i] == tokens[num_tokens - 1 - i]
        match_len += alive
    best = int(match_len.max())
    if best < min_n:
        return tokens[:0]
    start = int(ends[np.argmax(match_len == best)]) + 1  # ends ascend: argmax finds the earliest
    return tokens[start:start + k]


class NgramProposer:
    """Proposes up to k tokens per sequence by prompt lookup (docs/spec_decode.md)."""

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int):
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        self._buffers: dict[int, tuple[np.ndarray, int]] = {}  # seq_id -> (tokens buffer, tokens in it)

    def propose(self, seqs: list[Sequence]) -> list[list[int]]:
        """A draft (maybe empty) for each sequence."""
        return [find_draft(self._tokens(seq), self.min_n, self.max_n, self.k).tolist() for seq in seqs]

    @staticmethod
    def take_draft_probs() -> dict:
        """Always empty: a lookup is deterministic given the tokens, so its drafts are verified one-hot."""
        return {}

    def retain(self, seq_ids: set[int]) -> None:
        """Forget the buffers of sequences not in `seq_ids` (finished, aborted, preempted)."""
        for seq_id in [s for s in self._buffers if s not in seq_ids]:
            del self._buffers[seq_id]

    def _tokens(self, seq: Sequence) -> np.ndarray:
        """seq's tokens as int64, converting only those added since the last call."""
        num_tokens = seq.num_tokens
        buf, n = self._buffers.get(seq.seq_id, (np.empty(0, dtype=np.int64), 0))
        n = min(n, num_tokens)
        if len(buf) < num_tokens:  # room to grow, so copies are amortised
            grown = np.empty(max(2 * num_tokens, 64), dtype=np.int64)
            grown[:n] = buf[:n]
            buf = grown
        buf[n:num_tokens] = seq.token_ids[n:]
        self._buffers[seq.seq_id] = (buf, num_tokens)
        return buf[:num_tokens]
