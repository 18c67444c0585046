"""HF transformers greedy decoding as the oracle, with the top-2 logit gap of every step."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM

NEAR_TIE = 1e-3  # steps whose top-2 logit gap is below this may legitimately flip


@dataclass
class Reference:
    token_ids: list[int]
    gaps: list[float]               # top-1 minus top-2 logit at each step
    logprobs: list[torch.Tensor]    # log_softmax of the raw logits at each step, [vocab]


@functools.lru_cache(maxsize=4)
def load_hf(path: str):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(path: str, prompt_ids: list[int], max_tokens: int) -> Reference:
    """Cached: every scheduling regime is checked against the same references."""
    return _hf_greedy(path, tuple(prompt_ids), max_tokens)


@functools.lru_cache(maxsize=256)
@torch.inference_mode()
def _hf_greedy(path: str, prompt_ids: tuple[int, ...], max_tokens: int) -> Reference:
    prompt_ids = list(prompt_ids)
    model = load_hf(path)
    out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                         max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                         output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    logits = [step[0].float() for step in out.logits]
    top2 = [lg.topk(2).values for lg in logits]
    return Reference(token_ids=out.sequences[0, len(prompt_ids):].tolist(),
                     gaps=[float(t[0] - t[1]) for t in top2],
                     logprobs=[torch.log_softmax(lg, -1) for lg in logits])


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
