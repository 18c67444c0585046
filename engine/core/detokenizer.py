"""Incremental detokenization and stop strings, for one sequence.

Decoding token by token is not `decode([t])` per token: a character can span
tokens (UTF-8 bytes of byte-level BPE), and a token's leading space depends on
its left neighbour (sentencepiece). So each step decodes a small window of
recent ids twice and emits the difference:

    ids:   ... | prefix_offset ........ read_offset ........ end |
                 \\__ already emitted __/\\____ new, pending ____/
    new text = decode(ids[prefix_offset:])[len(decode(ids[prefix_offset:read_offset])):]

Nothing is emitted while the window's text ends with U+FFFD (an unfinished
character); then the read part becomes the next prefix. The window holds a
few tokens, so a step costs O(window), not O(length).
"""
from __future__ import annotations

from engine.sampling_params import SamplingParams

try:  # transformers >= 5: the fast tokenizers' class
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    from transformers.tokenization_utils_tokenizers import TokenizersBackend
except ImportError:  # pragma: no cover - older transformers: always go through tokenizer.decode
    PreTrainedTokenizerBase = TokenizersBackend = None

_PROMPT_CONTEXT = 5        # prompt ids kept as left context for the first output tokens (vLLM's choice)
_MAX_PENDING_TOKENS = 16   # a UTF-8 character needs <= 4 byte tokens; past this the bytes are garbage, emit them
_TRIM_AT = 64              # drop ids left of the window once this many have piled up
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], sampling_params: SamplingParams):
        self.tokenizer = tokenizer
        self._backend_decode = _backend_decode(tokenizer)
        self.skip_special_tokens = sampling_params.skip_special_tokens
        self.stop: list[str] = list(sampling_params.stop or [])
        self.include_stop_str_in_output = sampling_params.include_stop_str_in_output
        self.max_stop_len = max((len(s) for s in self.stop), default=0)
        # Streamed text keeps back what could be the start of a stop string that is later cut.
        # With the stop string included nothing before its end is ever cut, so nothing is held.
        self.stop_buffer_length = (self.max_stop_len - 1
                                   if self.stop and not self.include_stop_str_in_output else 0)
        self.output_text = ""
        # Only the window is kept, not the whole sequence: ids[prefix_offset:] is all that is decoded.
        self._ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text: str | None = None  # decode(ids[prefix_offset:read_offset]), cached
        self._num_returned = 0  # chars of output_text already handed out as deltas

    def update(self, new_token_ids: list[int]) -> str | None:
        """Append sampled ids; return the stop string they completed, if any (output_text is then cut)."""
        if not new_token_ids:
            return None
        self._ids.extend(new_token_ids)
        new_text = self._decode_new()
        if not new_text:
            return None
        self.output_text += new_text
        return self._check_stop(len(new_text))

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text to hand out now: all of it, or (delta) only what was not handed out before."""
        held = 0 if finished else self.stop_buffer_length
        end = max(len(self.output_text) - held, 0)
        if not delta:
            return self.output_text[:end]
        start = self._num_returned
        if end <= start:
            return ""
        self._num_returned = end
        return self.output_text[start:end]

    # -- internals ----------------------------------------------------------
    def _decode(self, ids: list[int]) -> str:
        # No clean-up of spaces: it looks across token boundaries and would break the difference.
        if self._backend_decode is not None:
            return self._backend_decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def _decode_new(self) -> str:
        """Text of the pending ids, or "" while they end inside a character."""
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        text = self._decode(self._ids[self._prefix_offset:])
        num_pending = len(self._ids) - self._read_offset
        unfinished = len(text) <= len(self._prefix_text) or text.endswith(_REPLACEMENT)
        if unfinished and num_pending < _MAX_PENDING_TOKENS:
            return ""  # a partial character, or only skipped special tokens so far
        new_text = text[len(self._prefix_text):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._prefix_text = None
        if self._prefix_offset >= _TRIM_AT:
            del self._ids[:self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return new_text

    def _check_stop(self, num_new_chars: int) -> str | None:
        """Find a stop string that ends in the new text; cut output_text there."""
        if not self.stop:
            return None
        text = self.output_text
        # A match must end inside the new text, so it starts at most max_stop_len - 1 chars before it.
        start = max(len(text) - num_new_chars - self.max_stop_len + 1, 0)
        best_pos, best_stop = len(text), None
        for stop in self.stop:
            pos = text.find(stop, start, best_pos + len(stop))  # only matches starting before the best one
            if pos != -1 and pos < best_pos:
                best_pos, best_stop = pos, stop
        if best_stop is None:
            return None
        cut = best_pos + len(best_stop) if self.include_stop_str_in_output else best_pos
        self.output_text = text[:cut]
        return best_stop


def _backend_decode(tokenizer):
    """The Rust `tokenizers` decode that `tokenizer.decode` wraps, when it adds nothing else.

    With clean-up off, a fast tokenizer's `decode(ids)` is exactly its backend's
    `decode(ids, skip_special_tokens)`; the Python layers around it (argument
    conversion, kwargs plumbing) cost several times the decode itself, twice per
    token per sequence. A class that overrides either layer keeps the full path.
    """
    if TokenizersBackend is None or not isinstance(tokenizer, TokenizersBackend):
        return None
    cls = type(tokenizer)
    if cls.decode is not PreTrainedTokenizerBase.decode or cls._decode is not TokenizersBackend._decode:
        return None
    backend = getattr(tokenizer, "_tokenizer", None)
    return getattr(backend, "decode", None)


def decode_token(tokenizer, token_id: int) -> str:
    """One token's text, for logprob records (`Logprob.decoded_token`).

    A token holding part of a character decodes to U+FFFD, as in vLLM.
    """
    return tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)
