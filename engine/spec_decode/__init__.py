"""Speculative decoding (docs/spec_decode.md): proposers of draft tokens, and the engine's side.

    ngram_proposer.py    prompt lookup over the request's own tokens (numpy)
    draft_model_proposer.py  a small checkpoint's k steps (argmax, or sampled with q), its own KV pool (torch)
    draft_sampler.py     the draft's token at each step, and q for sampled requests (torch)
    acceptance_guard.py  per-sequence pause when drafts keep being rejected
    spec_decoder.py      drafts before each step, counters and the guard after it

The verification itself is the model runner's: lookahead slots from the scheduler
(engine/core/scheduler.py), k + 1 rows per sequence in one forward, and
engine/worker/rejection_sampler.py.
"""
from __future__ import annotations

from engine.config import EngineConfig, ModelConfig
from engine.spec_decode.spec_decoder import NoSpecDecoder, SpecDecoder


def make_spec_decoder(config: EngineConfig, model_config: ModelConfig, num_kv_blocks: int,
                      eos_token_ids: list[int]) -> SpecDecoder | NoSpecDecoder:
    """The engine's spec decoder for a resolved config (the target's model, KV block count, and the
    EOS ids its sampler holds back for min_tokens: the model config's and the tokenizer's)."""
    spec = config.speculative_config
    if spec is None:
        return NoSpecDecoder()
    if spec.method == "ngram":
        from engine.spec_decode.ngram_proposer import NgramProposer

        proposer = NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
    else:
        from engine.spec_decode.draft_model_proposer import DraftModelProposer  # torch

        proposer = DraftModelProposer(config, spec, model_config, num_kv_blocks, eos_token_ids)
    return SpecDecoder(proposer, spec.num_speculative_tokens, pause_without_drafts=bool(config.async_scheduling))
