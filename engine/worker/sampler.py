"""Turns one step's logits into next tokens, plus their logprobs when asked.

One row per sampling sequence, all batched in float32 `[num_seqs, vocab]`:

    grammar bitmask -> raw logprobs -> allowed_token_ids -> bad_words -> min_tokens
      -> logit_bias -> penalties (vLLM V1's order; engine/worker/logits_controls.py)
      -> greedy rows: argmax
      -> other rows:  / temperature -> top-k, top-p (one sort) -> min-p -> exponential race

Which stages run is decided from the Python-side params, never from tensor
values, so nothing here waits for the device: `sample()` returns the tokens
on the device (`SampledTokens`), and the only host sync of a step is its
`to_host()`, which overlapped scheduling defers to after the next launch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.core.messages import ModelRunnerOutput, SampleLogprobs
from engine.core.sequence import Sequence
from engine.worker.forward_context import to_device
from engine.worker.logits_controls import RowGuard, TokenControls, apply_bad_words

_U64 = (1 << 64) - 1  # torch generators take an unsigned 64-bit seed


class Sampler:
    """Samples the next token of each sequence.

    Randomness: token i is drawn as `argmax(probs / E)` with `E_i ~ Exp(1)`
    (the "exponential race": the smallest `E_i / p_i` wins with probability
    `p_i / sum(p)`). The noise of a seeded row comes from that sequence's own
    generator and always has `vocab` elements, so its tokens depend only on
    its seed and its logits, not on the batch around it.
    """

    def __init__(self, eos_token_ids: list[int] | int | None = None, seed: int = 0,
                 device: torch.device | str | None = None, stream_salt: int = 0):
        """stream_salt: mixed into every generator's seed, so that a second sampler over the same
        requests (a draft model's) draws streams of its own, seeded requests' included."""
        if isinstance(eos_token_ids, int):
            eos_token_ids = [eos_token_ids]
        self.eos_token_ids: list[int] = list(eos_token_ids or [])
        self.seed = seed
        self.stream_salt = stream_salt
        self._generator: torch.Generator | None = None  # unseeded rows; lives on the logits' device
        self._seq_generators: dict[int, torch.Generator] = {}  # seq_id -> generator of a seeded sequence
        self.token_controls = TokenControls()  # logit_bias and allowed_token_ids tensors per sequence
        if device is not None:
            device = torch.device(device)
            if device.type == "cuda" and device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())  # match logits.device
            self.engine_generator(device)

    def free(self, seq_id: int) -> None:
        """Forget a finished sequence's generator and token controls."""
        self._seq_generators.pop(seq_id, None)
        self.token_controls.free(seq_id)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence],
                 allowed_token_bitmask: torch.Tensor | None = None,
                 ) -> tuple[list[int], list[SampleLogprobs | None] | None]:
        """Sample and wait for the result: (token ids, logprob records or None)."""
        return self.sample(logits, seqs, allowed_token_bitmask).to_host()

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, seqs: list[Sequence],
               allowed_token_bitmask: torch.Tensor | None = None) -> SampledTokens:
        """Launch sampling; the result stays on the device (see SampledTokens)."""
        if logits.dim() != 2 or logits.shape[0] != len(seqs):
            raise ValueError(f"logits must be [num_seqs={len(seqs)}, vocab], got {tuple(logits.shape)}")
        if not seqs:
            return SampledTokens(torch.empty(0, dtype=torch.long, device=logits.device))
        if allowed_token_bitmask is None and is_plain_greedy(seqs):
            # No stage would change the logits: argmax of the model's own logits, no copy.
            return SampledTokens(logits.argmax(dim=-1))
        # [num_seqs, vocab], a contiguous float32 copy: the stages below work in place.
        logits = logits.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
        if allowed_token_bitmask is not None:
            apply_token_bitmask(logits, allowed_token_bitmask)
        params = [s.sampling_params for s in seqs]
        want_logprobs = any(p.logprobs is not None for p in params)
        # vLLM V1's default (logprobs_mode="raw_logprobs"): logprobs of the model's distribution
        # under the grammar, before the request's own edits, penalties and temperature.
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
        self.process_logits(logits, seqs)
        sampled = self._sample(logits, seqs)  # [num_seqs] int64
        if raw_logprobs is None:
            return SampledTokens(sampled)
        ks = [p.logprobs for p in params]
        return SampledTokens(sampled, pack_logprob_records(sampled, raw_logprobs, ks), ks)

    # -- stages ------------------------------------------------------------
    def process_logits(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """The request's own edits and the penalties, in place, in vLLM V1's order."""
        guard = RowGuard(logits, seqs)
        self.token_controls.apply_allowed_token_ids(logits, seqs)
        apply_bad_words(logits, seqs)
        self._apply_min_tokens(logits, seqs)
        self.token_controls.apply_logit_bias(logits, seqs)
        apply_penalties(logits, seqs)
        guard.restore_emptied(logits)

    def _apply_min_tokens(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """Forbid eos and stop tokens while a sequence is shorter than its min_tokens."""
        vocab = logits.shape[1]
        flat: list[int] = []  # row * vocab + token, into the flattened logits
        for i, seq in enumerate(seqs):
            p = seq.sampling_params
            if seq.num_output_tokens >= p.min_tokens:
                continue
            blocked = set(p.stop_token_ids)
            if not p.ignore_eos:
                blocked.update(self.eos_token_ids)
            for t in blocked:
                if t < vocab:
                    flat.append(i * vocab + t)
        if flat:
            logits.view(-1).index_fill_(0, to_device(flat, torch.int64, logits.device), float("-inf"))

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """[num_seqs, vocab] processed logits -> [num_seqs] int64 token ids."""
        params = [s.sampling_params for s in seqs]
        greedy = [p.is_greedy for p in params]
        if all(greedy):
            return logits.argmax(dim=-1)
        return self.draw(self.sampling_probs(logits, params, greedy), logits, seqs, greedy)

    def draw(self, probs: torch.Tensor, logits: torch.Tensor, seqs: list[Sequence],
             greedy: list[bool]) -> torch.Tensor:
        """[num_seqs] token ids: the argmax of `logits` for greedy rows, the exponential race over
        `probs` ([num_seqs, vocab], overwritten) for the others."""
        sampled = self._exponential_race(probs, seqs, greedy)
        if any(greedy):
            is_greedy = to_device([float(g) for g in greedy], torch.float32, logits.device)
            sampled = torch.where(is_greedy > 0.5, logits.argmax(dim=-1), sampled)
        return sampled

    @staticmethod
    def sampling_probs(logits: torch.Tensor, params: list, greedy: list[bool]) -> torch.Tensor:
        """[rows, vocab] processed logits -> [rows, vocab] unnormalised probabilities: temperature,
        top-k, top-p, min-p."""
        vocab = logits.shape[1]
        # Greedy rows get neutral knobs: their random sample is computed, then discarded.
        knobs = to_device([
            [1.0 if g else p.temperature for p, g in zip(params, greedy)],
            [float(vocab if g or p.top_k == 0 else min(p.top_k, vocab)) for p, g in zip(params, greedy)],
            [1.0 if g else p.top_p for p, g in zip(params, greedy)],
            [0.0 if g else p.min_p for p, g in zip(params, greedy)],
        ], torch.float32, logits.device)  # [4, num_seqs]
        temperature, top_k, top_p, min_p = knobs
        sampling = [p for p, g in zip(params, greedy) if not g]
        use_top_k = any(p.top_k > 0 for p in sampling)
        use_top_p = any(p.top_p < 1.0 for p in sampling)

        scaled = logits / temperature.unsqueeze(1)  # new tensor: `logits` stays for the greedy argmax
        if use_top_k or use_top_p:
            scaled = apply_top_k_top_p(scaled, top_k.long() if use_top_k else None,
                                       top_p if use_top_p else None)
        probs = scaled.softmax(dim=-1)
        if any(p.min_p > 0.0 for p in sampling):
            apply_min_p(probs, min_p)
        return probs

    def _exponential_race(self, probs: torch.Tensor, seqs: list[Sequence], greedy: list[bool]) -> torch.Tensor:
        """argmax(probs / E), E ~ Exp(1): a categorical sample that needs no normalised probs.

        probs: [num_seqs, vocab], overwritten. Returns [num_seqs] int64.
        """
        seeded = [i for i, (s, g) in enumerate(zip(seqs, greedy)) if s.sampling_params.seed is not None and not g]
        q = torch.empty_like(probs)
        if len(seeded) < greedy.count(False):
            q.exponential_(generator=self.engine_generator(probs.device))
        else:
            q.fill_(1.0)  # only greedy rows left over; their result is discarded
        for i in seeded:
            q[i].exponential_(generator=self.seq_generator(seqs[i], probs.device))
        # An exact 0 would turn a masked (p=0) token into 0/0 = NaN, which argmax picks.
        q.clamp_min_(torch.finfo(q.dtype).tiny)
        return probs.div_(q).argmax(dim=-1)

    def engine_generator(self, device: torch.device) -> torch.Generator:
        if self._generator is None or self._generator.device != device:
            self._generator = torch.Generator(device=device)
            self._generator.manual_seed((self.seed ^ self.stream_salt) & _U64)
        return self._generator

    def seq_generator(self, seq: Sequence, device: torch.device) -> torch.Generator:
        gen = self._seq_generators.get(seq.seq_id)
        if gen is None:
            # + index: the n completions of one seeded request differ, yet each is reproducible.
            gen = torch.Generator(device=device)
            gen.manual_seed(((seq.sampling_params.seed + seq.index) ^ self.stream_salt) & _U64)
            self._seq_generators[seq.seq_id] = gen
        return gen


# -- batched logit processors (public for tests and for other samplers) -------
def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set disallowed tokens to -inf, in place.

    logits: [num_seqs, vocab]. bitmask: int32 [num_seqs, num_words], xgrammar's layout:
    bit j of word w allows token 32*w + j; a word of -1 allows all 32 tokens.
    """
    num_seqs, vocab = logits.shape
    if bitmask.dim() != 2 or bitmask.shape[0] != num_seqs or bitmask.shape[1] * 32 < vocab:
        raise ValueError(f"allowed_token_bitmask must be [{num_seqs}, >= {(vocab + 31) // 32}], "
                         f"got {tuple(bitmask.shape)}")
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and bitmask.dtype == torch.int32:
        # xgrammar (which filled the bitmask) has a CPU kernel: one pass, no [num_seqs, vocab]
        # temporaries, half the torch ops' CPU (docs/benchmarks.md, issue 32).
        from xgrammar import apply_token_bitmask_inplace

        apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab)
    else:
        _apply_token_bitmask_torch(logits, bitmask)


def _apply_token_bitmask_torch(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """apply_token_bitmask on any device, in torch ops (shapes checked by the caller)."""
    vocab = logits.shape[1]
    words = bitmask.to(logits.device, torch.int32, non_blocking=True)
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    # [num_seqs, num_words, 32] -> [num_seqs, num_words * 32]; token t is at column t.
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :vocab].bool()
    logits.masked_fill_(~allowed, float("-inf"))


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """Repetition, frequency and presence penalties, in place, on the rows that have any.

    repetition (HF/vLLM): every token seen in prompt or output has its logit
    divided by r when positive, multiplied by r when negative.
    frequency / presence (OpenAI): logit -= f * count_in_output + p * (count_in_output > 0).
    """
    rows = [i for i, s in enumerate(seqs) if s.sampling_params.has_penalties]
    if not rows:
        return
    device, vocab = logits.device, logits.shape[1]
    sub = [seqs[i] for i in rows]
    num_prompt = max(1, max(s.num_prompt_tokens for s in sub))
    num_output = max(1, max(s.num_output_tokens for s in sub))
    # One padded host tensor [num_rows, num_prompt + num_output]; pad id `vocab` counts into a
    # spare column that is dropped, so padding needs no mask.
    padded = [_pad(s.prompt_token_ids, num_prompt, vocab) + _pad(s.output_token_ids, num_output, vocab)
              for s in sub]
    tokens = to_device(padded, torch.int64, device).clamp_(max=vocab)  # out-of-vocab ids -> spare column
    knobs = to_device([[s.sampling_params.repetition_penalty, s.sampling_params.frequency_penalty,
                        s.sampling_params.presence_penalty] for s in sub], torch.float32, device)  # [num_rows, 3]
    output_counts = _count_tokens(tokens[:, num_prompt:], vocab)      # [num_rows, vocab]
    in_prompt = _count_tokens(tokens[:, :num_prompt], vocab) > 0      # [num_rows, vocab]
    seen = in_prompt | (output_counts > 0)

    all_rows = len(rows) == len(seqs)
    index = None if all_rows else to_device(rows, torch.int64, device)
    x = logits if all_rows else logits.index_select(0, index)  # [num_rows, vocab]
    rep = knobs[:, 0:1]
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    x = x - knobs[:, 1:2] * output_counts - knobs[:, 2:3] * (output_counts > 0).float()
    if all_rows:
        logits.copy_(x)
    else:
        logits.index_copy_(0, index, x)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                      top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask (-inf) tokens outside each row's top-k, then outside its top-p nucleus, with one sort.

    logits: [num_seqs, vocab]; top_k: [num_seqs] int64, vocab = off; top_p: [num_seqs], 1.0 = off.
    Ties with the k-th logit are kept. Returns a new tensor.
    """
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1)  # ascending: kept tokens form a suffix
    if top_k is not None:
        kth = sorted_logits.gather(1, (vocab - top_k).clamp_(0, vocab - 1).unsqueeze(1))  # [num_seqs, 1]
        sorted_logits.masked_fill_(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        # cum[j] = mass of token j and every less likely one. Dropping j still leaves
        # 1 - cum[j] >= top_p above it, so the kept suffix is the smallest with mass >= top_p.
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= (1.0 - top_p).unsqueeze(1)
        drop[:, -1] = False  # the most likely token always survives
        sorted_logits.masked_fill_(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def apply_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> None:
    """Zero (in place) probs below min_p * the row's max prob. probs: [num_seqs, vocab]; min_p: [num_seqs].

    No renormalisation: the exponential race only needs relative weights.
    """
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    probs.masked_fill_(probs < threshold, 0.0)


# -- helpers -------------------------------------------------------------------
def is_plain_greedy(seqs: list[Sequence]) -> bool:
    """Every row is greedy with no logprobs, no penalties, no token edits and no min_tokens still
    in force: then the sampled token is the argmax of the raw logits (the usual offline batch)."""
    for seq in seqs:
        p = seq.sampling_params
        if (not p.is_greedy or p.logprobs is not None or p.has_penalties or p.has_token_controls
                or (p.min_tokens and seq.num_output_tokens < p.min_tokens)):
            return False
    return True


def _count_tokens(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, length] ids in [0, vocab] -> [rows, vocab] float32 counts (id `vocab` is padding)."""
    counts = torch.zeros(tokens.shape[0], vocab + 1, dtype=torch.float32, device=tokens.device)
    counts.scatter_add_(1, tokens, torch.ones_like(tokens, dtype=torch.float32))
    return counts[:, :vocab]


def _pad(ids: list[int], length: int, pad_id: int) -> list[int]:
    return ids + [pad_id] * (length - len(ids))


def compute_prompt_logprobs(logits: torch.Tensor, target_ids: list[int], ks: list[int]) -> list[SampleLogprobs]:
    """logits: [num_rows, vocab] raw; row i scores prompt token target_ids[i] with top-ks[i].

    Only the rows that asked are here, so the log_softmax copy is [num_rows, vocab], not the chunk's.
    """
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    targets = to_device(target_ids, torch.int64, logits.device)
    return _logprob_records(targets, logprobs, ks)[1]


@dataclass
class SampledTokens:
    """One step's sampled tokens, on the device until `to_host()`.

    `start_copy()` queues the device-to-host copy behind the sampling kernels
    (pinned memory + an event), so a later `to_host()` waits only for this
    step, not for whatever was launched after it.
    """

    token_ids: torch.Tensor                    # [num_seqs] int64
    packed_logprobs: torch.Tensor | None = None  # [num_seqs, 3 + 2*max_k] float64, see pack_logprob_records
    ks: list[int | None] | None = None         # top-k per row, None = no record
    _host: list | None = None                  # pinned copies of the two tensors above, once started
    _event: torch.cuda.Event | None = None

    def start_copy(self) -> None:
        if self.token_ids.device.type != "cuda" or self._host is not None:
            return
        self._host, self._event = start_host_copy([self.token_ids, self.packed_logprobs])

    def to_host(self) -> tuple[list[int], list[SampleLogprobs | None] | None]:
        """Wait for the copy; (token ids, logprob records or None)."""
        if self._host is not None:
            self._event.synchronize()
            token_ids, packed = self._host[0], self._host[1] if len(self._host) > 1 else None
        else:
            token_ids, packed = self.token_ids, self.packed_logprobs
        if packed is None:
            return token_ids.tolist(), None
        return unpack_logprob_records(packed.tolist(), self.ks)

    def to_runner_output(self, prompt_logprobs=None) -> ModelRunnerOutput:
        token_ids, logprobs = self.to_host()
        return ModelRunnerOutput(sampled_token_ids=token_ids, logprobs=logprobs, prompt_logprobs=prompt_logprobs)


def start_host_copy(tensors: list[torch.Tensor | None]) -> tuple[list[torch.Tensor], torch.cuda.Event]:
    """Queue pinned-memory copies of the (CUDA) tensors that are not None, and an event after them."""
    host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
            for t in tensors if t is not None]
    event = torch.cuda.Event()
    event.record()
    return host, event


def _logprob_records(token_ids: torch.Tensor, logprobs: torch.Tensor, ks: list[int | None],
                     ) -> tuple[list[int], list[SampleLogprobs | None]]:
    """token_ids: [num_rows]; logprobs: [num_rows, vocab]; ks[i]: top-k of row i, None = no record."""
    return unpack_logprob_records(pack_logprob_records(token_ids, logprobs, ks).tolist(), ks)


def pack_logprob_records(token_ids: torch.Tensor, logprobs: torch.Tensor, ks: list[int | None]) -> torch.Tensor:
    """The records as one device tensor [num_rows, 3 + 2*max_k], so one copy brings them all back."""
    max_k = min(max(k or 0 for k in ks), logprobs.shape[1])
    token_logprob = logprobs.gather(1, token_ids.unsqueeze(1))        # [num_rows, 1]
    rank = (logprobs > token_logprob).sum(dim=1, keepdim=True) + 1  # 1-based; ties share the best rank
    # float64 holds int ids and float32 logprobs exactly, so one tensor carries everything:
    # [num_rows, 3 + 2*max_k] = id, logprob, rank, top ids..., top logprobs...
    columns = [token_ids.unsqueeze(1).double(), token_logprob.double(), rank.double()]
    if max_k:
        top_logprobs, top_ids = logprobs.topk(max_k, dim=-1)
        columns += [top_ids.double(), top_logprobs.double()]
    return torch.cat(columns, dim=1)


def unpack_logprob_records(packed: list[list[float]], ks: list[int | None],
                            ) -> tuple[list[int], list[SampleLogprobs | None]]:
    max_k = (len(packed[0]) - 3) // 2 if packed else 0
    ids = [int(row[0]) for row in packed]
    records: list[SampleLogprobs | None] = []
    for row, k in zip(packed, ks):
        if k is None:
            records.append(None)
            continue
        k = min(k, max_k)
        records.append(SampleLogprobs(
            token_id=int(row[0]), logprob=row[1], rank=int(row[2]),
            top_token_ids=[int(t) for t in row[3:3 + k]],
            top_logprobs=row[3 + max_k:3 + max_k + k]))
    return ids, records
