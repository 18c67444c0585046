"""The n-gram (prompt lookup) proposer: the longest suffix match, the earliest occurrence, k tokens."""
import random

import numpy as np
import pytest

from engine.core.sequence import Sequence
from engine.sampling_params import SamplingParams
from engine.spec_decode.ngram_proposer import NgramProposer, find_draft


def draft(tokens, min_n, max_n, k):
    return find_draft(np.array(tokens, dtype=np.int64), min_n, max_n, k).tolist()


def reference(tokens, min_n, max_n, k):
    """HF's prompt lookup, spelled out: for n from max_n down, the earliest earlier window equal to
    the last n tokens that has a token after it; propose up to k tokens from there."""
    for n in range(max_n, min_n - 1, -1):
        if n > len(tokens) - 1:
            continue
        suffix = tokens[len(tokens) - n:]
        for start in range(0, len(tokens) - n):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


@pytest.mark.parametrize("tokens, min_n, max_n, k, expected", [
    ([1, 2, 3, 4, 2, 3], 2, 3, 4, [4, 2, 3]),           # vLLM's example: [2, 3] matches, 3 tokens follow
    ([1, 2, 3, 4, 2, 3], 3, 3, 4, []),                  # no earlier [4, 2, 3]
    ([5, 9, 1, 2, 7, 8, 1, 2, 6, 1, 2], 2, 2, 2, [7, 8]),  # the earliest occurrence wins
    ([7, 1, 2, 3, 9, 2, 3, 8, 1, 2, 3], 2, 3, 2, [9, 2]),  # the longest suffix wins over an earlier shorter one
    ([4, 4, 4, 4], 1, 3, 5, [4]),                       # overlapping the suffix itself: what follows, capped
    ([1, 2, 3], 1, 1, 2, []),
    ([3], 1, 2, 2, []),
])
def test_find_draft(tokens, min_n, max_n, k, expected):
    assert draft(tokens, min_n, max_n, k) == expected == reference(tokens, min_n, max_n, k)


def test_equals_the_spelled_out_rule_on_random_repetitive_text():
    rng = random.Random(0)
    for _ in range(300):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 40))]
        min_n = rng.randrange(1, 4)
        max_n = rng.randrange(min_n, 6)
        k = rng.randrange(1, 6)
        assert draft(tokens, min_n, max_n, k) == reference(tokens, min_n, max_n, k), (tokens, min_n, max_n, k)


def test_proposer_follows_growing_sequences_and_forgets_finished_ones():
    proposer = NgramProposer(num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=3)
    seq = Sequence("r", [1, 2, 3, 4, 5], SamplingParams())
    other = Sequence("s", [8, 9, 8, 9], SamplingParams())
    assert proposer.propose([seq, other]) == [[], [8, 9]]
    for token_id in [1, 2] + list(range(100, 200)):  # past the buffer's first capacity
        seq.append_token(token_id)
    seq.append_token(100)
    seq.append_token(101)
    assert proposer.propose([seq]) == [[102, 103, 104]]
    proposer.retain({seq.seq_id})
    assert list(proposer._buffers) == [seq.seq_id]
