"""Verifies draft tokens (speculative decoding) against the target model, the whole batch at once.

A sequence with k drafts d_1..d_k computed k + 1 rows. Row i holds the target's logits for the
token after d_1..d_i (row 0: after the sequence's last token), so row i checks draft d_{i+1} and
the last row checks none (the bonus row):

    rows of one sequence:   r_0    r_1    ...   r_{k-1}   r_k
    checks:                 d_1    d_2    ...   d_k       -

Greedy rows accept the longest prefix with d_{i+1} == argmax(r_i) and emit the argmax of the
first row that disagreed (or of the bonus row): the tokens greedy decoding would have made.

Sampled rows use standard speculative sampling (Leviathan et al. 2023, Chen et al. 2023): accept
d_{i+1} with probability min(1, p_i(d) / q_i(d)), and at the first rejection emit a sample of
norm(max(0, p_i - q_i)); when all are accepted, a sample of p_k. The emitted tokens are then
distributed exactly as tokens drawn one at a time from p. A draft model's sampled drafts come
with q (`draft_probs`, from SchedulerOutput.spec_draft_probs: q_i of every draft, as the draft
model drew it). Other drafts (n-gram, argmax drafts of the draft model) are deterministic given
the context, so q is one-hot at the draft: accept with probability p_i(d), resample from p_i
with d taken out; that test is exact for a draft drawn in any way, only less often accepted than
q's own.

Each row's p is what `Sampler` samples from at that position: the request's edits, penalties,
min_tokens and bad words see the drafts before the row as output (`_DraftView`), then
temperature, top-k / top-p and min-p. All of it is tensor ops over the rows; Python loops run
over sequences only (building the row views, and the seeded sequences' own generators).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.core.messages import ModelRunnerOutput
from engine.core.sequence import Sequence
from engine.worker.forward_context import to_device
from engine.worker.sampler import (Sampler, apply_token_bitmask, is_plain_greedy, pack_logprob_records,
                                   start_host_copy, unpack_logprob_records)


class RejectionSampler:
    def __init__(self, sampler: Sampler):
        self.sampler = sampler  # its stages, token controls and generators (one state per sequence)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence], drafts: list[list[int]],
                 allowed_token_bitmask: torch.Tensor | None = None,
                 draft_probs: dict[int, torch.Tensor] | None = None) -> VerifiedTokens:
        """logits: [num_rows, vocab], num_rows = sum(len(d) + 1 for d in drafts), each sequence's rows
        together in `seqs` order. allowed_token_bitmask: [num_rows, words], a grammar's mask for
        each row (StructuredOutputManager.fill_bitmask_rows). draft_probs: seq_id -> q [len(draft),
        vocab] of the drafts sampled from q (SchedulerOutput.spec_draft_probs); the rest are one-hot."""
        counts = [len(d) + 1 for d in drafts]
        if logits.dim() != 2 or logits.shape[0] != sum(counts):
            raise ValueError(f"logits must be [num_rows={sum(counts)}, vocab], got {tuple(logits.shape)}")
        rows = _Rows(drafts, counts, logits.device)
        plain = allowed_token_bitmask is None and is_plain_greedy(seqs)
        if not plain:  # a float32 copy that the stages edit in place
            logits = logits.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
            if allowed_token_bitmask is not None:
                apply_token_bitmask(logits, allowed_token_bitmask)
        ks = [s.sampling_params.logprobs for s, n in zip(seqs, counts) for _ in range(n)]
        want_logprobs = any(k is not None for k in ks)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None  # vLLM's raw_logprobs
        if not plain:
            self.sampler.process_logits(logits, _row_views(seqs, drafts))
        q = _DraftProbs.of(seqs, drafts, draft_probs, logits.shape[1], logits.device) if draft_probs else None
        num_accepted, final = self._verify(logits, seqs, rows, q)
        out = VerifiedTokens(final, num_accepted, counts)
        if raw_logprobs is not None:
            # The token each row emits: its draft while accepted, then the sequence's final token.
            row_tokens = torch.where(rows.pos < num_accepted[rows.seq], rows.draft, final[rows.seq])
            out.packed_logprobs, out.ks = pack_logprob_records(row_tokens, raw_logprobs, ks), ks
        return out

    def _verify(self, logits: torch.Tensor, seqs: list[Sequence], rows: _Rows,
                q: _DraftProbs | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Processed logits [num_rows, vocab] -> (accepted drafts [num_seqs], final token [num_seqs])."""
        params = [s.sampling_params for s in seqs]
        greedy = [p.is_greedy for p in params]
        target_argmax = logits.argmax(dim=-1)  # [num_rows]
        accept = target_argmax == rows.draft
        if all(greedy):
            num_accepted = rows.leading_run(accept)
            return num_accepted, target_argmax[rows.first + num_accepted]
        row_params = [p for p, n in zip(params, rows.counts_list) for _ in range(n)]
        row_greedy = [g for g, n in zip(greedy, rows.counts_list) for _ in range(n)]
        probs = Sampler.sampling_probs(logits, row_params, row_greedy)  # [num_rows, vocab], unnormalised
        probs /= probs.sum(dim=-1, keepdim=True)  # p: normalised, to compare with q
        uniform, noise = self._random(seqs, greedy, rows, probs.shape[1], probs.device)
        p_draft = probs.gather(1, rows.draft.unsqueeze(1)).squeeze(1)  # [num_rows]
        accept_prob = p_draft if q is None else torch.where(q.has_q, p_draft / q.at_draft(rows), p_draft)
        is_greedy = to_device(greedy, torch.bool, logits.device)
        accept = torch.where(is_greedy[rows.seq], accept, uniform < accept_prob)
        num_accepted = rows.leading_run(accept)
        final_row = rows.first + num_accepted  # [num_seqs]
        # The first rejected row's residual norm(max(0, p - q)), or the bonus row's p. One-hot q:
        # p with the draft taken out. (A rejected draft of a real q has p(d) < q(d): no mass left at d.)
        resample = probs[final_row]  # [num_seqs, vocab], a copy
        rejected = (num_accepted < rows.num_drafts).unsqueeze(1)
        draft = rows.draft[final_row].unsqueeze(1)
        resample.scatter_(1, draft, torch.where(rejected, 0.0, resample.gather(1, draft)))
        if q is not None:  # q's rows at the final rows: 0 for one-hot drafts and bonus rows
            resample = resample.sub_(q.at_rows(final_row)).clamp_min_(0.0)
        # Rounding can leave nothing (p(d) ~ 1 yet rejected, or p ~ q): keep p then.
        resample = torch.where(resample.sum(dim=-1, keepdim=True) > 0, resample, probs[final_row])
        sampled = resample.div_(noise).argmax(dim=-1)  # exponential race (Sampler's docstring)
        final = torch.where(is_greedy, target_argmax[final_row], sampled)
        return num_accepted, final

    def _random(self, seqs: list[Sequence], greedy: list[bool], rows: _Rows, vocab: int,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Uniforms [num_rows] for the accept tests, Exp(1) noise [num_seqs, vocab] for the final
        sample. A seeded sequence draws both from its own generator (a uniform per draft, then its
        noise: without drafts exactly what `Sampler` draws), so its tokens depend on its seed and
        its own logits only, whether or not the batch around it speculates."""
        gen = self.sampler.engine_generator(device)
        uniform = torch.rand(rows.num_rows, generator=gen, device=device)
        noise = torch.empty(len(seqs), vocab, device=device).exponential_(generator=gen)
        first = 0
        for i, (seq, n) in enumerate(zip(seqs, rows.counts_list)):
            if seq.sampling_params.seed is not None and not greedy[i]:
                seq_gen = self.sampler.seq_generator(seq, device)
                if n > 1:
                    uniform[first:first + n - 1] = torch.rand(n - 1, generator=seq_gen, device=device)
                noise[i].exponential_(generator=seq_gen)
            first += n
        # An exact 0 would turn a masked (p = 0) token into 0/0 = NaN, which argmax picks.
        return uniform, noise.clamp_min_(torch.finfo(noise.dtype).tiny)


class _Rows:
    """Where each sequence's rows are, as device tensors (built from per-sequence lists, no row loop)."""

    def __init__(self, drafts: list[list[int]], counts: list[int], device: torch.device):
        self.counts_list = counts
        self.num_rows = sum(counts)
        self.max_count = max(counts)
        flat: list[int] = []
        for d in drafts:  # each row's draft; 0 for a bonus row (never accepted: `has_draft` masks it)
            flat += d
            flat.append(0)
        self.draft = to_device(flat, torch.long, device)                       # [num_rows]
        self.counts = to_device(counts, torch.long, device)                    # [num_seqs]
        self.num_drafts = self.counts - 1                                      # [num_seqs]
        self.first = torch.cumsum(self.counts, 0) - self.counts                # [num_seqs] first row
        self.seq = torch.repeat_interleave(torch.arange(len(counts), device=device), self.counts,
                                           output_size=self.num_rows)          # [num_rows] its sequence
        self.pos = torch.arange(self.num_rows, device=device) - self.first[self.seq]  # [num_rows] i
        self.has_draft = self.pos < self.num_drafts[self.seq]                 # [num_rows]

    def leading_run(self, accept: torch.Tensor) -> torch.Tensor:
        """[num_rows] bool -> [num_seqs]: how many of each sequence's drafts are accepted in a row."""
        grid = torch.zeros(len(self.counts_list), self.max_count, dtype=torch.long, device=accept.device)
        grid[self.seq, self.pos] = (accept & self.has_draft).long()
        return grid.cumprod(dim=1).sum(dim=1)


class _DraftProbs:
    """The q rows of the drafts that have one (`draft_probs`), laid out for the batch's rows: a table
    [num_q_rows + 1, vocab] whose last row is 0, and each row's index into it (the zero row for
    one-hot drafts and bonus rows)."""

    def __init__(self, table: torch.Tensor, index: torch.Tensor):
        self.table = table                              # [num_q_rows + 1, vocab]
        self.index = index                              # [num_rows]
        self.has_q = index < table.shape[0] - 1         # [num_rows]

    @classmethod
    def of(cls, seqs: list[Sequence], drafts: list[list[int]], draft_probs: dict[int, torch.Tensor],
           vocab: int, device: torch.device) -> _DraftProbs | None:
        """None when no draft in the batch has q (n-gram, argmax drafts): the one-hot test alone."""
        per_seq = [draft_probs.get(seq.seq_id) for seq in seqs]  # q [len(draft), vocab] or None
        for d, p in zip(drafts, per_seq):
            if p is not None and tuple(p.shape) != (len(d), vocab):
                raise ValueError(f"draft_probs must be [num_draft_tokens={len(d)}, vocab={vocab}], "
                                 f"got {tuple(p.shape)}")
        parts = [p for p in per_seq if p is not None]
        if not parts:
            return None
        zero = sum(p.shape[0] for p in parts)
        index: list[int] = []
        first = 0
        # Per sequence: its drafts' q rows (or the zero row), then its bonus row's (the zero row).
        for d, p in zip(drafts, per_seq):
            if p is not None:
                index.extend(range(first, first + len(d)))
                first += len(d)
            else:
                index.extend([zero] * len(d))
            index.append(zero)
        table = torch.cat([p.to(device, torch.float32) for p in parts] + [torch.zeros(1, vocab, device=device)])
        return cls(table, to_device(index, torch.long, device))

    def at_draft(self, rows: _Rows) -> torch.Tensor:
        """[num_rows]: q(d) of each row's draft (0 where the row has no q)."""
        return self.table[self.index, rows.draft]

    def at_rows(self, row: torch.Tensor) -> torch.Tensor:
        """[n] row numbers -> [n, vocab]: q of those rows (0 where a row has no q)."""
        return self.table[self.index[row]]


class _DraftView:
    """A sequence as row i of its verification sees it: its first i drafts appended as output. Has
    what the sampler's token-dependent stages read (penalties, bad words, min_tokens, controls)."""

    __slots__ = ("_seq", "_drafts")

    def __init__(self, seq: Sequence, drafts: list[int]):
        self._seq, self._drafts = seq, drafts

    sampling_params = property(lambda self: self._seq.sampling_params)
    seq_id = property(lambda self: self._seq.seq_id)
    index = property(lambda self: self._seq.index)
    bad_words_token_ids = property(lambda self: self._seq.bad_words_token_ids)
    num_prompt_tokens = property(lambda self: self._seq.num_prompt_tokens)
    prompt_token_ids = property(lambda self: self._seq.prompt_token_ids)
    token_ids = property(lambda self: self._seq.token_ids + self._drafts)
    output_token_ids = property(lambda self: self._seq.output_token_ids + self._drafts)
    num_output_tokens = property(lambda self: self._seq.num_output_tokens + len(self._drafts))


def _row_views(seqs: list[Sequence], drafts: list[list[int]]) -> list:
    return [seq if i == 0 else _DraftView(seq, d[:i]) for seq, d in zip(seqs, drafts) for i in range(len(d) + 1)]


@dataclass
class VerifiedTokens:
    """One verification step's result, on the device until `to_runner_output()` (as SampledTokens)."""

    token_ids: torch.Tensor        # [num_seqs] the token after each sequence's accepted drafts
    num_accepted: torch.Tensor     # [num_seqs] int64
    counts: list[int]              # rows per sequence (its drafts + 1)
    packed_logprobs: torch.Tensor | None = None  # [num_rows, 3 + 2*max_k] (sampler.pack_logprob_records)
    ks: list[int | None] | None = None           # per row
    _host: list | None = None
    _event: torch.cuda.Event | None = None

    def start_copy(self) -> None:
        if self.token_ids.device.type == "cuda" and self._host is None:
            self._host, self._event = start_host_copy(
                [torch.stack([self.token_ids, self.num_accepted]), self.packed_logprobs])

    def to_runner_output(self, prompt_logprobs=None) -> ModelRunnerOutput:
        if self._host is not None:
            self._event.synchronize()
            ids_and_accepted, packed = self._host[0], self._host[1] if len(self._host) > 1 else None
        else:
            ids_and_accepted, packed = torch.stack([self.token_ids, self.num_accepted]), self.packed_logprobs
        token_ids, num_accepted = ids_and_accepted.tolist()
        out = ModelRunnerOutput(sampled_token_ids=token_ids, num_accepted_tokens=num_accepted,
                                prompt_logprobs=prompt_logprobs)
        if packed is not None:
            _, records = unpack_logprob_records(packed.tolist(), self.ks)
            out.logprobs, out.accepted_logprobs, first = [], [], 0
            for n, a in zip(self.counts, num_accepted):
                out.accepted_logprobs.append(records[first:first + a])
                out.logprobs.append(records[first + a])
                first += n
        return out
