"""Speculative decoding (docs/spec_decode.md): proposers of draft tokens, and the engine's side.

    ngram_proposer.py    prompt lookup over the request's own tokens (numpy)
    acceptance_guard.py  per-sequence pause when drafts keep being rejected
    spec_decoder.py      drafts before each step, counters and the guard after it

The verification itself is the model runner's: lookahead slots from the scheduler
(engine/core/scheduler.py), k + 1 rows per sequence in one forward, and
engine/worker/rejection_sampler.py.
"""
from __future__ import annotations

from engine.config import EngineConfig, ModelConfig
from engine.spec_decode.spec_decoder import NoSpecDecoder, SpecDecoder


def make_spec_decoder(config: EngineConfig, model_config: ModelConfig,
                      num_kv_blocks: int) -> SpecDecoder | NoSpecDecoder:
    """The engine's spec decoder for a resolved config (the target's model and KV block count)."""
    spec = config.speculative_config
    if spec is None:
        return NoSpecDecoder()
    if spec.method != "ngram":
        raise ValueError(f"speculative_config.method={spec.method!r} is not available yet")
    from engine.spec_decode.ngram_proposer import NgramProposer

    proposer = NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
    return SpecDecoder(proposer, spec.num_speculative_tokens)
