"""HF transformers greedy decoding as the oracle, with the top-2 logit gap of every step."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from engine.loader.gguf_config import gguf_source
from loadtest.hf_peer import load_hf_from_gguf

NEAR_TIE = 1e-3  # steps whose top-2 logit gap is below this may legitimately flip


@dataclass
class Reference:
    token_ids: list[int]
    gaps: list[float]               # top-1 minus top-2 logit at each step
    logprobs: list[torch.Tensor]    # log_softmax of the raw logits at each step, [vocab]


@functools.lru_cache(maxsize=4)
def load_hf(path: str):
    gguf_file = gguf_source(Path(path))
    if gguf_file is not None:  # transformers' own GGUF reading, not ours
        return load_hf_from_gguf(path, gguf_file).eval()
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(path: str, prompt_ids: list[int], max_tokens: int) -> Reference:
    """Cached: every scheduling regime is checked against the same references."""
    return _hf_greedy(path, tuple(prompt_ids), max_tokens)


@functools.lru_cache(maxsize=256)
@torch.inference_mode()
def _hf_greedy(path: str, prompt_ids: tuple[int, ...], max_tokens: int) -> Reference:
    # A bare argmax loop over HF's forward and KV cache: `generate` would add logits
    # processors (min_new_tokens bans EOS), and the oracle must be the model alone.
    model = load_hf(path)
    out = model(torch.tensor([list(prompt_ids)]), use_cache=True)
    tokens, gaps, logprobs = [], [], []
    for _ in range(max_tokens):
        logits = out.logits[0, -1].float()
        top2 = logits.topk(2).values
        tok = int(logits.argmax())
        tokens.append(tok)
        gaps.append(float(top2[0] - top2[1]))
        logprobs.append(torch.log_softmax(logits, -1))
        out = model(torch.tensor([[tok]]), past_key_values=out.past_key_values, use_cache=True)
    return Reference(token_ids=tokens, gaps=gaps, logprobs=logprobs)


def assert_matches(ours: list[int], ref: Reference, what: str = "") -> None:
    """Equal token for token, except after a step where the reference itself nearly tied."""
    n = min(len(ours), len(ref.token_ids))
    for i in range(n):
        if ours[i] != ref.token_ids[i]:
            assert ref.gaps[i] < NEAR_TIE, (
                f"{what}: token {i} differs (ours {ours[i]}, HF {ref.token_ids[i]}, HF top-2 gap "
                f"{ref.gaps[i]:.2e})\nours {ours}\nHF   {ref.token_ids}")
            return
    assert len(ours) == len(ref.token_ids), f"{what}: length {len(ours)} != HF {len(ref.token_ids)}"


@torch.inference_mode()
def hf_prompt_logprobs(path: str, prompt_ids: list[int]) -> torch.Tensor:
    """[num_prompt_tokens, vocab]: row i is log_softmax of HF's raw logits given tokens <= i
    (so row i - 1 scores prompt token i)."""
    logits = load_hf(path)(torch.tensor([list(prompt_ids)])).logits[0].float()
    return torch.log_softmax(logits, -1)
