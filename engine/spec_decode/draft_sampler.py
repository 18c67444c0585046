"""The draft model's token at each of its steps: argmax for greedy shadows, a sample of q for sampled ones.

q is the draft's distribution after the request's own processing, by the target's `Sampler` stages:
allowed_token_ids, bad_words, min_tokens, logit_bias, penalties (on the shadow, whose earlier
drafts count as output, as the target's rows see them), then temperature, top-k / top-p, min-p.
The closer q is to the target's p, the more drafts the rejection sampler accepts; whatever q is,
the output keeps the target's distribution, as long as each draft is drawn from the q handed on.

Randomness: an exponential race (`Sampler`'s docstring) on noise from this sampler's own
generators, seeded apart from the target's (`draft_seed`): the draft's draws and the target's
acceptance uniforms must not be one stream, or the test is biased. A seeded request draws from
a generator of its own, so its drafts, like its tokens, depend on its seed and its logits only.
"""
from __future__ import annotations

import torch

from engine.core.sequence import Sequence
from engine.worker.forward_context import to_device
from engine.worker.sampler import Sampler

_U64 = (1 << 64) - 1
# Mixed into every seed the draft uses. Its low 32 bits are not 0: a CPU generator reads those only.
_DRAFT_SEED_SALT = 0x9E3779B97F4A7C15


def draft_seed(seed: int) -> int:
    """The seed of the draft's stream for a target stream seeded `seed`: never the same stream."""
    return (seed ^ _DRAFT_SEED_SALT) & _U64


class DraftSampler:
    def __init__(self, eos_token_ids: list[int], seed: int, device: torch.device):
        # The target's stages on the draft's logits, with generators apart from the target's.
        self.sampler = Sampler(eos_token_ids=eos_token_ids, seed=draft_seed(seed), device=device)
        self._seq_generators: dict[int, torch.Generator] = {}  # shadow seq_id -> its seeded generator

    def free(self, seq_id: int) -> None:
        """Forget a shadow's generator and token controls."""
        self._seq_generators.pop(seq_id, None)
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
        tokens = (q / self._noise(shadows, greedy, q)).argmax(dim=-1)
        if any(greedy):
            is_greedy = to_device(greedy, torch.bool, logits.device)
            tokens = torch.where(is_greedy, logits.argmax(dim=-1), tokens)
        return tokens, q

    def _noise(self, shadows: list[Sequence], greedy: list[bool], q: torch.Tensor) -> torch.Tensor:
        """Exp(1) noise [num_shadows, vocab]: a seeded shadow's row from its own generator."""
        noise = torch.empty_like(q).exponential_(generator=self.sampler.engine_generator(q.device))
        for i, (shadow, g) in enumerate(zip(shadows, greedy)):
            if shadow.sampling_params.seed is not None and not g:
                noise[i].exponential_(generator=self._seq_generator(shadow, q.device))
        # An exact 0 would turn a masked (q = 0) token into 0/0 = NaN, which argmax picks.
        return noise.clamp_min_(torch.finfo(noise.dtype).tiny)

    def _seq_generator(self, shadow: Sequence, device: torch.device) -> torch.Generator:
        gen = self._seq_generators.get(shadow.seq_id)
        if gen is None:  # + index, as the target's: each of a request's n completions its own stream
            gen = self._seq_generators[shadow.seq_id] = torch.Generator(device=device)
            gen.manual_seed(draft_seed(shadow.sampling_params.seed + shadow.index))
        return gen
