"""Structured output by grammar-constrained decoding (xgrammar): every form of StructuredOutputsParams.

    compile(params)      worker thread; checked and compiled once per constraint (LRU cache), each
                         form by engine/core/grammar_forms.py
    new_matcher(c)       one Matcher per sequence; it lives on the Sequence, so it survives preemption
    fill_bitmask(...)    step loop; int32 [num_seqs, ceil(vocab/32)], applied to the logits first
    follow(token_ids)    after each sampled token; is_finished() then says whether the document is done
    draft_prefix(d)      speculative decoding: how many of a draft's tokens the grammar takes, and
    draft_masks(d)       the mask of every verified position; both leave the matcher as it was

On top of the grammar, constrained rows never allow special tokens other than the stop tokens,
and JSON rows no tokens with raw control bytes (see `_writable_token_ids`).

Reasoning models (EngineConfig.reasoning_parser): a matcher whose prompt did not close the
thinking allows every token (its bitmask row is all ones) until the sequence writes the end of
the thinking (`</think>`); the grammar constrains the answer from the next token on, and never
sees the thinking or its end token, as in vLLM.
"""
from __future__ import annotations

import collections
import os
import threading
from dataclasses import dataclass

import torch
import xgrammar as xgr

from engine.core.grammar_forms import CONTROL_BYTES_ALLOWED, compile_form
from engine.errors import InvalidRequestError
from engine.math_utils import cdiv
from engine.sampling_params import StructuredOutputsParams


def _to_int32(word: int) -> int:
    """An unsigned 32-bit word as the signed int32 that torch stores."""
    return word - (1 << 32) if word >= 1 << 31 else word


@dataclass(frozen=True)
class CompiledConstraint:
    """A compiled grammar and the form it came from (which tokens the form may write)."""

    grammar: xgr.CompiledGrammar
    form: str  # StructuredOutputsParams.form


class Matcher:
    """The grammar state of one sequence. Used by one thread at a time (the step loop)."""

    def __init__(self, compiled: xgr.CompiledGrammar, num_words: int, non_stop_words: torch.Tensor,
                 writable_words: torch.Tensor, reasoning_parser=None, reasoning_ended: bool = True):
        self._matcher = xgr.GrammarMatcher(compiled)
        self._non_stop_words = non_stop_words  # int32 [num_words]: every token but the stop tokens
        self._writable_words = writable_words  # int32 [num_words]: see _writable_token_ids
        self._mask = torch.empty((1, num_words), dtype=torch.int32)  # next token's allowed set
        self._mask_stale = True  # the mask is filled at most once per accepted token
        # engine/reasoning parser (start_token_id, end_token_id, is_reasoning_end), or None
        self._reasoning_parser = reasoning_parser
        self.reasoning_ended = reasoning_ended  # False while a reasoning model is still thinking

    def follow(self, token_ids: list[int], position: int = -1) -> None:
        """Take the sequence's token at `position` (default its newest; token_ids: prompt + output)."""
        if self.reasoning_ended:
            self.accept_token(token_ids[position])
            return
        # The thinking ends only with the end token, which this grammar never sees.
        parser = self._reasoning_parser
        end = len(token_ids) if position == -1 else position + 1
        self.reasoning_ended = token_ids[end - 1] == parser.end_token_id and parser.is_reasoning_end(token_ids[:end])

    def draft_prefix(self, draft_token_ids: list[int]) -> int:
        """How many leading draft tokens the grammar takes, stopping before a stop token (the
        verification's last row samples that); 0 while the thinking goes on. State unchanged."""
        if not self.reasoning_ended:
            return 0
        n = 0
        for token_id in draft_token_ids:
            if not self._matcher.accept_token(token_id):
                break
            if self._matcher.is_terminated():
                self._matcher.rollback(1)
                break
            n += 1
        if n:
            self._matcher.rollback(n)
        return n

    def draft_masks(self, draft_token_ids: list[int]) -> torch.Tensor:
        """int32 [len(drafts) + 1, num_words]: row i allows what may follow the first i drafts,
        which the grammar must take (draft_prefix cut them so). State unchanged."""
        masks = torch.empty((len(draft_token_ids) + 1, self._mask.shape[1]), dtype=torch.int32)
        for i, token_id in enumerate(draft_token_ids):
            self._matcher.fill_next_token_bitmask(masks, i)
            if not self._matcher.accept_token(token_id):
                raise RuntimeError(f"draft token {token_id} is not allowed by the grammar (draft_prefix cuts it)")
        self._matcher.fill_next_token_bitmask(masks, len(draft_token_ids))
        self._matcher.rollback(len(draft_token_ids))
        return _keep_writable(masks, self._writable_words)

    def accept_token(self, token_id: int) -> None:
        if not self._matcher.accept_token(token_id):
            raise RuntimeError(f"token {token_id} is not allowed by the grammar (was the bitmask applied?)")
        self._mask_stale = True

    def next_token_mask(self) -> torch.Tensor:
        """int32 [num_words]: bit j of word w set <=> token 32*w + j may come next."""
        if self._mask_stale:
            self._matcher.fill_next_token_bitmask(self._mask, 0)
            self._mask.copy_(_keep_writable(self._mask, self._writable_words))
            self._mask_stale = False
        return self._mask[0]

    @property
    def mask_is_stale(self) -> bool:
        """No mask is cached for the current state (a token was accepted since the last fill)."""
        return self._mask_stale

    @property
    def writable_words(self) -> torch.Tensor:
        return self._writable_words

    def is_finished(self) -> bool:
        """The sequence must end now: the grammar accepted a stop token (also with ignore_eos,
        where the scheduler would not stop on it), or the document is complete and nothing but
        a stop token may follow. The second case ends the sequence before sampling, so a row
        whose only allowed tokens the sampler then bans (min_tokens bans eos) never occurs."""
        if not self.reasoning_ended:
            return False
        if self._matcher.is_terminated():
            return True
        if not self._matcher.is_completed():  # mid-document: no mask needed to know
            return False
        return not bool((self.next_token_mask() & self._non_stop_words).any())


class StructuredOutputManager:
    """Compiles structured-output requests against one tokenizer and builds the per-step bitmask."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int] | None = None,
                 max_cached_grammars: int = 256):
        # The model's vocab may be padded past the tokenizer's; xgrammar then treats the padding
        # ids as special tokens, which no grammar allows.
        full_vocab = max(vocab_size, len(tokenizer))
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=full_vocab, stop_token_ids=stop_token_ids)
        # Our own LRU below is the one bound on memory, so xgrammar's cache is off.
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=min(8, os.cpu_count() or 1),
                                             cache_enabled=False)
        self.num_words = cdiv(full_vocab, 32)
        self.stop_token_ids = list(self.tokenizer_info.stop_token_ids)
        self._non_stop_words = self._words_with(set(range(full_vocab)) - set(self.stop_token_ids))
        special = set(getattr(tokenizer, "all_special_ids", ())) - set(self.stop_token_ids)
        self._writable_words = self._words_with(self._writable_token_ids(special, control_bytes=False))
        self._textual_words = self._words_with(self._writable_token_ids(special, control_bytes=True))
        self._cache: collections.OrderedDict[str, CompiledConstraint] = collections.OrderedDict()
        self._max_cached = max_cached_grammars
        self._lock = threading.Lock()  # compile() runs on worker threads
        # xgrammar's threads fill the rows of a step in parallel (its default count: half the cores).
        # With no core to spare (2 cores, both the forward's) they only wait on each other and on
        # the forward's threads: the step thread then fills the rows itself.
        fill_threads = min(8, (os.cpu_count() or 1) // 2)
        self._batch_matcher = xgr.BatchGrammarMatcher(max_threads=fill_threads) if fill_threads > 1 else None
        self._fill_rows = self._fill_batched if self._batch_matcher is not None else self._fill_serial

    def _writable_token_ids(self, special: set[int], control_bytes: bool) -> set[int]:
        """Tokens a document may contain, on top of what the grammar says:
        - no special token but the stop tokens (every form): the detokenizer drops them, so the
          text would not be what the grammar accepted;
        - for JSON (control_bytes=False), none with a raw control byte (U+0000-U+001F): JSON
          forbids them inside strings and our JSON grammars have no free whitespace, yet
          xgrammar 0.2.8 lets them into strings with minLength/maxLength (mlc-ai/xgrammar#800).
          A regex, choice, grammar or structural tag says itself where a newline or tab may go
          (grammar_forms.CONTROL_BYTES_ALLOWED), and filtering them would silently narrow it."""
        return {t for t, piece in enumerate(self.tokenizer_info.decoded_vocab)
                if t not in special and (control_bytes or not any(b < 0x20 for b in piece))} | set(self.stop_token_ids)

    def _words_with(self, token_ids) -> torch.Tensor:
        """int32 [num_words] with exactly the bits of `token_ids` set."""
        words = [0] * self.num_words
        for t in token_ids:
            words[t // 32] |= 1 << (t % 32)
        return torch.tensor([_to_int32(w) for w in words], dtype=torch.int32)

    def compile(self, params: StructuredOutputsParams) -> CompiledConstraint:
        """The compiled grammar of a request; InvalidRequestError names what is invalid or unsupported."""
        key = params.key()
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                return compiled
        # Compiled outside the lock so that one large schema does not hold up the others; two
        # threads compiling the same new schema at once both finish, and the first one is kept.
        compiled = self._compile_uncached(params)
        with self._lock:
            compiled = self._cache.setdefault(key, compiled)
            self._cache.move_to_end(key)
            while len(self._cache) > self._max_cached:
                self._cache.popitem(last=False)
        return compiled

    def _compile_uncached(self, params: StructuredOutputsParams) -> CompiledConstraint:
        compiled = CompiledConstraint(compile_form(self._compiler, params), params.form)
        # A grammar whose only document is the empty one would end the sequence before its first
        # token (and e.g. a regex "()" asks for nothing a model can write): refused up front.
        if self.new_matcher(compiled).is_finished():
            raise InvalidRequestError(f"structured_outputs.{params.form} is invalid: it allows only the empty output",
                                      param=f"structured_outputs.{params.form}")
        return compiled

    def new_matcher(self, compiled: CompiledConstraint, reasoning_parser=None,
                    prompt_token_ids: list[int] = ()) -> Matcher:
        """A sequence's matcher; with a reasoning parser, it waits for the thinking to end unless
        the prompt ended it already (e.g. Qwen3's enable_thinking=False template)."""
        writable = self._textual_words if compiled.form in CONTROL_BYTES_ALLOWED else self._writable_words
        reasoning_ended = reasoning_parser is None or reasoning_parser.is_reasoning_end(prompt_token_ids)
        return Matcher(compiled.grammar, self.num_words, self._non_stop_words, writable,
                       reasoning_parser, reasoning_ended)

    def fill_bitmask(self, matchers: list[Matcher | None]) -> torch.Tensor:
        """int32 [len(matchers), num_words] on CPU, xgrammar's layout (bit j of word w = token
        32*w + j). Rows without a live grammar (none, finished, or waiting for the reasoning to
        end) are all ones (-1): every token allowed."""
        bitmask = torch.full((len(matchers), self.num_words), -1, dtype=torch.int32)
        live = [i for i, m in enumerate(matchers) if m is not None and m.reasoning_ended and not m.is_finished()]
        # A matcher whose mask is still current (is_finished() filled it) is copied, the rest filled
        # here straight into the step's rows, and every row then narrowed in a few batched ops.
        stale = [i for i in live if matchers[i].mask_is_stale]
        self._fill_rows([matchers[i] for i in stale], bitmask, stale)
        for i in live:
            if not matchers[i].mask_is_stale:
                bitmask[i] = matchers[i].next_token_mask()
        groups: dict[int, tuple[torch.Tensor, list[int]]] = {}  # id(writable words) -> (them, rows)
        for i in stale:
            groups.setdefault(id(matchers[i].writable_words), (matchers[i].writable_words, []))[1].append(i)
        for writable, rows in groups.values():
            index = torch.tensor(rows)
            bitmask.index_copy_(0, index, _keep_writable(bitmask.index_select(0, index), writable))
        return bitmask

    def fill_bitmask_rows(self, matchers: list[Matcher | None], drafts: list[list[int]]) -> torch.Tensor:
        """fill_bitmask with a row per verified position (speculative decoding): a sequence with k
        draft tokens gets k + 1 rows, its grammar's masks after each draft; the others one row each."""
        bitmask = self.fill_bitmask(matchers)
        parts = []
        for i, (matcher, draft) in enumerate(zip(matchers, drafts)):
            if draft and matcher is not None and matcher.reasoning_ended and not matcher.is_finished():
                parts.append(matcher.draft_masks(draft))
            else:
                parts.append(bitmask[i:i + 1].expand(len(draft) + 1, -1))
        return torch.cat(parts)

    def _fill_serial(self, matchers: list[Matcher], bitmask: torch.Tensor, rows: list[int]) -> None:
        for matcher, i in zip(matchers, rows):
            matcher._matcher.fill_next_token_bitmask(bitmask, i)

    def _fill_batched(self, matchers: list[Matcher], bitmask: torch.Tensor, rows: list[int]) -> None:
        if rows:
            self._batch_matcher.batch_fill_next_token_bitmask([m._matcher for m in matchers], bitmask, rows)


def _keep_writable(filled: torch.Tensor, writable: torch.Tensor) -> torch.Tensor:
    """filled: int32 [num_rows, num_words] from xgrammar; writable: int32 [num_words]. Each row
    narrowed to the writable tokens, unless that empties it: never empty a row (the guardrail
    still checks what comes out)."""
    narrowed = filled & writable
    return torch.where(narrowed.ne(0).any(dim=1, keepdim=True), narrowed, filled)
