"""The draft model's token at each of its steps: argmax for greedy shadows, a sample of q for sampled ones.

q is the draft's distribution after the request's own processing, by the target's `Sampler` stages:
allowed_token_ids, bad_words, min_tokens, logit_bias, penalties (on the shadow, whose earlier
drafts count as output, as the target's rows see them), then temperature, top-k / top-p, min-p.
The closer q is to the target's p, the more drafts the rejection sampler accepts; whatever q is,
the output keeps the target's distribution, as long as each draft is drawn from the q handed on.

Randomness: the target `Sampler`'s exponential race, on generators salted apart from the target's
(`stream_salt`): the draft's draws and the target's acceptance uniforms must not be one stream, or
the test is biased. A seeded request draws from a generator of its own, so its drafts, like its
tokens, depend on its seed and its logits only.
"""
from __future__ import annotations

import torch

from engine.core.sequence import Sequence
from engine.worker.sampler import Sampler

# Mixed into every seed the draft uses. Its low 32 bits are not 0: a CPU generator reads those only.
_DRAFT_STREAM_SALT = 0x9E3779B97F4A7C15


class DraftSampler:
    def __init__(self, eos_token_ids: list[int], seed: int, device: torch.device):
        # The target's stages on the draft's logits, with generators apart from the target's.
        self.sampler = Sampler(eos_token_ids=eos_token_ids, seed=seed, device=device, stream_salt=_DRAFT_STREAM_SALT)

    def free(self, seq_id: int) -> None:
        """Forget a shadow's generator and token controls."""
        self.sampler.free(seq_id)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, shadows: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """logits: [num_shadows, vocab], the draft's rows for `shadows` -> (token ids [num_shadows],
        q [num_shadows, vocab] normalised, or None when every shadow is greedy). A greedy shadow's
        row of q is meaningless (its token is the argmax)."""
        params = [s.sampling_params for s in shadows]
        greedy = [p.is_greedy for p in params]
        if all(greedy):
            return logits.argmax(dim=-1), None
        logits = logits.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
        self.sampler.process_logits(logits, shadows)
        q = Sampler.sampling_probs(logits, params, greedy)
        q /= q.sum(dim=-1, keepdim=True)
        return self.sampler.draw(q.clone(), logits, shadows, greedy), q
