"""Draft-model proposals: a small checkpoint with the target's tokenizer runs k greedy steps.

The draft runs in the engine's process on its own `ModelRunner` (its weights, its KV cache) with
its own `BlockManager` pool of the target's block size and block count. Each target sequence has
a shadow `Sequence` there, whose tokens follow the target's and whose KV the draft computes:

    propose():  sync each shadow with its target sequence (keep the KV of the tokens both agree on,
                free the rest), then
                step 1: every shadow computes the tokens it has not yet seen (a new sequence: its
                        prompt, chunked by max_num_batched_tokens) and samples d_1
                step j: one token each, d_{j-1} in, d_j out (j = 2 .. k)

A shadow that gets no blocks proposes nothing this step (the target decodes without drafts); the
pool holds as many blocks as the target's, and full blocks of agreed tokens go to its prefix
cache, so n > 1 siblings and repeated prompts share them as they do in the target.
"""
from __future__ import annotations

import logging

from engine.config import EngineConfig, ModelConfig, SpeculativeConfig
from engine.core.block_manager import BlockManager
from engine.core.messages import SchedulerOutput
from engine.core.sequence import Sequence
from engine.loader.model_path import resolve_model_path
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
_GREEDY = SamplingParams(temperature=0, max_tokens=None)


class DraftModelProposer:
    def __init__(self, config: EngineConfig, spec: SpeculativeConfig, target: ModelConfig, num_kv_blocks: int):
        from engine.worker.model_runner import ModelRunner  # torch: only with a draft model

        path = resolve_model_path(spec.model)
        draft = ModelConfig.from_pretrained(path)
        _check_draft(spec, draft, target, config.max_model_len)
        draft_config = EngineConfig(
            model=str(path), dtype=config.dtype, device=config.device, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens, max_model_len=config.max_model_len,
            block_size=config.block_size, num_kv_blocks=num_kv_blocks, enforce_eager=True,
            attention_backend=config.attention_backend, seed=config.seed, async_scheduling=False,
        ).resolve(draft)
        self.runner = ModelRunner(draft_config, draft, path, eos_token_ids=[])
        self.block_manager = BlockManager(num_kv_blocks, config.block_size, enable_prefix_caching=True)
        self.k = spec.num_speculative_tokens
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self._shadows: dict[int, Sequence] = {}  # target seq_id -> its shadow
        self._num_synced: dict[int, int] = {}    # target seq_id -> tokens its shadow is known to share
        logger.info("draft model %s: %d KV blocks", draft.architecture, num_kv_blocks)

    def retain(self, seq_ids: set[int]) -> None:
        for seq_id in [s for s in self._shadows if s not in seq_ids]:
            self.block_manager.free(self._shadows.pop(seq_id))
            del self._num_synced[seq_id]

    def propose(self, seqs: list[Sequence]) -> list[list[int]]:
        shadows = [self._sync(seq) for seq in seqs]
        active = self._first_step(shadows)
        for _ in range(self.k - 1):
            if not active:
                break
            self._run(self._decode_step(active))
        return [s.token_ids[self._num_synced[seq.seq_id]:] for seq, s in zip(seqs, shadows)]

    # -- the shadow sequences -------------------------------------------------------------------
    def _sync(self, seq: Sequence) -> Sequence:
        """The shadow of `seq`, holding exactly `seq`'s tokens and KV for as many as both agree on
        (its last drafts are compared with what the target accepted)."""
        shadow = self._shadows.get(seq.seq_id)
        if shadow is None:
            shadow = self._shadows[seq.seq_id] = Sequence(seq.request_id, seq.token_ids, _GREEDY)
            agreed = seq.num_tokens
        else:
            agreed = _common_prefix(shadow.token_ids, seq.token_ids, start=self._num_synced[seq.seq_id])
            del shadow.token_ids[agreed:]
            shadow.token_ids.extend(seq.token_ids[agreed:])
            shadow.num_computed_tokens = min(shadow.num_computed_tokens, agreed)
            self.block_manager.free_blocks_past(shadow, shadow.num_computed_tokens)
            self.block_manager.cache_full_blocks(shadow)
        self._num_synced[seq.seq_id] = seq.num_tokens
        return shadow

    def _allocate(self, shadow: Sequence, budget: int) -> int:
        """Blocks for the shadow's next chunk (within `budget` tokens) and, if that chunk ends its
        unseen tokens, for the k - 1 drafts after it; the chunk's length, 0 (no change) if they don't fit."""
        bm, cached = self.block_manager, 0
        if not shadow.block_table:  # new, or its KV all dropped: look in the prefix cache first
            cached = bm.get_computed_blocks(shadow)
        num_unseen = shadow.num_tokens - shadow.num_computed_tokens - cached
        chunk = min(num_unseen, budget)
        lookahead = self.k - 1 if chunk == num_unseen else 0
        return chunk if bm.allocate_slots(shadow, chunk + lookahead, num_computed_from_cache=cached) else 0

    # -- the draft's steps ----------------------------------------------------------------------
    def _first_step(self, shadows: list[Sequence]) -> list[Sequence]:
        """Every shadow's unseen tokens (within the token budget), then d_1; returns those that sampled."""
        so = SchedulerOutput(seqs=[], num_scheduled_tokens=[])
        budget = self.max_num_batched_tokens
        for shadow in shadows:
            chunk = self._allocate(shadow, budget) if budget > 0 else 0
            if chunk:
                self._schedule(so, shadow, chunk, samples=shadow.num_computed_tokens + chunk == shadow.num_tokens)
                budget -= chunk
        return self._run(so)

    def _decode_step(self, active: list[Sequence]) -> SchedulerOutput:
        so = SchedulerOutput(seqs=[], num_scheduled_tokens=[])
        for shadow in active:
            self._schedule(so, shadow, 1, samples=True)
        return so

    @staticmethod
    def _schedule(so: SchedulerOutput, shadow: Sequence, num_new: int, samples: bool) -> None:
        so.seqs.append(shadow)
        so.num_scheduled_tokens.append(num_new)
        so.num_computed_tokens.append(shadow.num_computed_tokens)
        so.sample_flags.append(samples)

    def _run(self, so: SchedulerOutput) -> list[Sequence]:
        """One forward of the draft; appends each sampling shadow's greedy token. Returns those."""
        if so.is_empty:
            return []
        handle = self.runner.sample(self.runner.forward(so))
        tokens = self.runner.collect(handle).sampled_token_ids
        for shadow, n in zip(so.seqs, so.num_scheduled_tokens):
            shadow.num_computed_tokens += n
        sampled = so.sampled_seqs
        for shadow, token_id in zip(sampled, tokens):
            shadow.append_token(token_id)
        return sampled


def _common_prefix(a: list[int], b: list[int], start: int) -> int:
    """Length of the common prefix of a and b, known to be at least `start`."""
    n = min(len(a), len(b))
    i = start
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _check_draft(spec: SpeculativeConfig, draft: ModelConfig, target: ModelConfig, max_model_len: int) -> None:
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"speculative_config.model={spec.model!r}: its vocab_size={draft.vocab_size} is not the "
                         f"target's {target.vocab_size} (a draft must share the target's tokenizer)")
    if max_model_len > draft.max_position_embeddings:
        raise ValueError(f"speculative_config.model={spec.model!r}: max_model_len={max_model_len} exceeds its "
                         f"max_position_embeddings={draft.max_position_embeddings}")

