"""Draft-model proposals: a small checkpoint with the target's tokenizer runs k steps.

The draft runs in the engine's process on its own `ModelRunner` (its weights, its KV cache) with
its own `BlockManager` pool of the target's block size and block count. With tensor parallelism
that process is rank 0, and the draft is built and run there whole (`unsharded`, vLLM's draft
tensor parallel size of 1): a small model's forward costs less than the collectives sharding
it would add, and the workers never see it. Each target sequence has
a shadow `Sequence` there, whose tokens follow the target's and whose KV the draft computes:

    propose():  sync each shadow with its target sequence (keep the KV of the tokens both agree on,
                free the rest), then
                step 1: every shadow computes the tokens it has not yet seen (a new sequence: its
                        prompt, chunked by max_num_batched_tokens) and samples d_1
                step j: one token each, d_{j-1} in, d_j out (j = 2 .. k)

A shadow that gets no blocks proposes nothing this step (the target decodes without drafts); the
pool holds as many blocks as the target's, and full blocks of agreed tokens go to its prefix
cache, so n > 1 siblings and repeated prompts share them as they do in the target.

Greedy requests get the draft's argmax at each step. Sampled ones get a sample of the draft's q
(draft_sampler.py), and q's rows go to the rejection sampler (`take_draft_probs` -> SpecDecoder
-> SchedulerOutput.spec_draft_probs, cut with the drafts), which accepts d with probability
min(1, p(d) / q(d)): a draft model close to the target has nearly all its drafts accepted, where
an argmax draft is accepted with probability p(argmax).
Requests with a grammar keep argmax drafts: the grammar cuts a draft at a token it refuses, and
a cut that depends on the drawn tokens would bias the q test (the one-hot test holds for any draft).
"""
from __future__ import annotations

import logging

import torch

from engine.config import EngineConfig, ModelConfig, SpeculativeConfig
from engine.core.block_manager import BlockManager
from engine.core.messages import SchedulerOutput
from engine.core.sequence import Sequence
from engine.executor.parallel_state import unsharded
from engine.loader.model_path import resolve_model_path
from engine.sampling_params import SamplingParams
from engine.spec_decode.draft_sampler import DraftSampler
from engine.worker.forward_context import to_device

logger = logging.getLogger(__name__)
_GREEDY = SamplingParams(temperature=0, max_tokens=None)


class DraftModelProposer:
    def __init__(self, config: EngineConfig, spec: SpeculativeConfig, target: ModelConfig, num_kv_blocks: int,
                 eos_token_ids: list[int]):
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
        with unsharded():  # whole on rank 0, beside a target sharded over tensor_parallel_size ranks
            self.runner = ModelRunner(draft_config, draft, path, eos_token_ids=[])
        # The target sampler's EOS ids (the tokenizer's too), so min_tokens holds back in q what it does in p.
        self.sampler = DraftSampler(eos_token_ids, config.seed, self.runner.device)
        self.block_manager = BlockManager(num_kv_blocks, config.block_size, enable_prefix_caching=True)
        self.k = spec.num_speculative_tokens
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self._shadows: dict[int, Sequence] = {}  # target seq_id -> its shadow
        self._num_synced: dict[int, int] = {}    # target seq_id -> tokens its shadow is known to share
        # q while a proposal is made: [num sampled shadows, k, vocab], row of each sampled shadow's seq_id.
        self._draft_probs: torch.Tensor | None = None
        self._probs_row: dict[int, int] = {}
        self._taken_probs: dict[int, torch.Tensor] = {}  # the last proposal's, until taken
        logger.info("draft model %s: %d KV blocks", draft.architecture, num_kv_blocks)

    def retain(self, seq_ids: set[int]) -> None:
        for seq_id in [s for s in self._shadows if s not in seq_ids]:
            shadow = self._shadows.pop(seq_id)
            self.block_manager.free(shadow)
            self.sampler.free(shadow.seq_id)
            del self._num_synced[seq_id]

    def propose(self, seqs: list[Sequence]) -> list[list[int]]:
        shadows = [self._sync(seq) for seq in seqs]
        sampling = [s for s in shadows if not s.sampling_params.is_greedy]
        self._probs_row, self._draft_probs = {s.seq_id: i for i, s in enumerate(sampling)}, None
        active = self._first_step(shadows)
        for step in range(1, self.k):
            if not active:
                break
            self._run(self._decode_step(active), step)
        drafts = [s.token_ids[self._num_synced[seq.seq_id]:] for seq, s in zip(seqs, shadows)]
        self._taken_probs = self._probs_by_seq(seqs, shadows, drafts)
        self._draft_probs = None
        return drafts

    def take_draft_probs(self) -> dict[int, torch.Tensor]:
        """The last proposal's q, once: target seq_id -> [len(draft), vocab] for each sampled,
        non-empty draft (argmax drafts have none)."""
        probs, self._taken_probs = self._taken_probs, {}
        return probs

    def _probs_by_seq(self, seqs: list[Sequence], shadows: list[Sequence],
                      drafts: list[list[int]]) -> dict[int, torch.Tensor]:
        """target seq_id -> q [len(draft), vocab] of each sampled shadow's non-empty draft (views
        of this proposal's `_draft_probs`)."""
        rows = [(seq.seq_id, self._probs_row.get(shadow.seq_id), len(draft))
                for seq, shadow, draft in zip(seqs, shadows, drafts)]
        return {seq_id: self._draft_probs[row, :n] for seq_id, row, n in rows if row is not None and n}

    # -- the shadow sequences -------------------------------------------------------------------
    def _sync(self, seq: Sequence) -> Sequence:
        """The shadow of `seq`, holding exactly `seq`'s tokens and KV for as many as both agree on
        (its last drafts are compared with what the target accepted)."""
        shadow = self._shadows.get(seq.seq_id)
        if shadow is None:
            shadow = self._shadows[seq.seq_id] = _make_shadow(seq)
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
        return self._run(so, 0)

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

    @torch.inference_mode()
    def _run(self, so: SchedulerOutput, step: int) -> list[Sequence]:
        """One forward of the draft; appends each sampling shadow's draft `step` (0-based) and keeps
        the q it was drawn from. Returns those shadows."""
        if so.is_empty:
            return []
        with unsharded():
            logits = self.runner.forward(so).logits  # [len(sampled), vocab]: a shadow never scores its prompt
        for shadow, n in zip(so.seqs, so.num_scheduled_tokens):
            shadow.num_computed_tokens += n
        sampled = so.sampled_seqs
        if not sampled:  # only chunks of prompts that go on next step
            return []
        tokens, probs = self.sampler(logits, sampled)
        if probs is not None:
            self._keep_probs(sampled, probs, step)
        for shadow, token_id in zip(sampled, tokens.tolist()):
            shadow.append_token(token_id)
        return sampled

    def _keep_probs(self, sampled: list[Sequence], probs: torch.Tensor, step: int) -> None:
        """Copy the sampled shadows' rows of q [len(sampled), vocab] to their draft `step`, in one op."""
        if self._draft_probs is None:
            self._draft_probs = probs.new_empty(len(self._probs_row), self.k, probs.shape[1])
        pairs = [(i, self._probs_row[s.seq_id]) for i, s in enumerate(sampled) if s.seq_id in self._probs_row]
        src, dst = (to_device(list(c), torch.long, probs.device) for c in zip(*pairs))
        self._draft_probs[dst, step] = probs[src]


def _make_shadow(seq: Sequence) -> Sequence:
    """A shadow with `seq`'s prompt and output (output counts for penalties and min_tokens) and the
    params its draft is made with: greedy (argmax drafts) for a greedy request or one with a grammar,
    else the request's sampling knobs, nothing that would make the draft score or return more."""
    params = _GREEDY if seq.sampling_params.is_greedy or seq.grammar is not None else _draft_params(seq.sampling_params)
    shadow = Sequence(seq.request_id, seq.prompt_token_ids, params, index=seq.index)
    shadow.token_ids.extend(seq.output_token_ids)
    shadow.bad_words_token_ids = seq.bad_words_token_ids
    return shadow


def _draft_params(p: SamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p, seed=p.seed,
        presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty, min_tokens=p.min_tokens, stop_token_ids=p.stop_token_ids,
        ignore_eos=p.ignore_eos, logit_bias=p.logit_bias, allowed_token_ids=p.allowed_token_ids,
        bad_words=p.bad_words, max_tokens=None)


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

