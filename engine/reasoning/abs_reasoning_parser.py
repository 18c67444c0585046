"""The reasoning parser interface: a completion's `<think>...</think>` to `reasoning_content`.

`extract` splits a whole completion; `streamer()` splits it delta by delta, holding back a
partial tag ("</thi") until the next text tells. The two agree however the text is split
(tests/test_reasoning_parsers.py feeds every split). `is_reasoning_end` answers, on token ids,
whether the thinking is over, so the engine knows when a grammar may start to constrain.

Subclasses differ in one fact: whether a completion that does not open with `<think>` is
thinking (the chat template opened `<think>` in the prompt: DeepSeek-R1) or the answer (Qwen3).
"""
from __future__ import annotations

from collections.abc import Sequence

from engine.entrypoints.tool_parsers.utils import partial_tag_len


def single_token_id(tokenizer, text: str) -> int | None:
    """The id of `text` when the tokenizer encodes it as exactly one token, else None.

    Takes a transformers tokenizer (encode returns ids) or a `tokenizers.Tokenizer` (an Encoding).
    """
    encoded = tokenizer.encode(text, add_special_tokens=False)
    ids = getattr(encoded, "ids", encoded)
    return ids[0] if len(ids) == 1 else None


class ReasoningParser:
    start_tag = "<think>"
    end_tag = "</think>"
    # True when the chat template opens the thinking in the prompt, so a completion that does
    # not start with `start_tag` is still thinking until `end_tag`.
    starts_in_reasoning = False

    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer
        self.start_token_id = None if tokenizer is None else single_token_id(tokenizer, self.start_tag)
        self.end_token_id = None if tokenizer is None else single_token_id(tokenizer, self.end_tag)

    def extract(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole completion; None where empty or absent."""
        opened = text.lstrip()
        if opened.startswith(self.start_tag):
            body = opened[len(self.start_tag):]  # whitespace before <think> only precedes it
        elif self.starts_in_reasoning:
            body = text
        else:
            return None, text or None
        reasoning, _, content = body.partition(self.end_tag)
        return reasoning or None, content or None

    def is_reasoning_end(self, token_ids: Sequence[int]) -> bool:
        """Whether the thinking is over in prompt + output ids so far: an end tag after the last
        start tag. True when the prompt itself closed it (Qwen3's enable_thinking=False writes
        "<think>\\n\\n</think>\\n\\n" there); False while no end tag came, as the model may be
        about to think (so a grammar waits for `</think>` rather than forbid thinking)."""
        if self.end_token_id is None:
            raise ValueError(
                f"{type(self).__name__} needs a tokenizer with {self.end_tag!r} as one token in its vocab"
            )
        for token_id in reversed(token_ids):
            if token_id == self.end_token_id:
                return True
            if token_id == self.start_token_id:
                return False
        return False

    def streamer(self) -> ReasoningStreamer:
        return ReasoningStreamer(self)


class ReasoningStreamer:
    """Splits one completion's text deltas into (reasoning, content) deltas.

    A state machine: `_phase` is the current state (opening -> thinking -> answering, or opening
    -> answering), a method that consumes `_buffer` and returns True to be called again.
    """

    def __init__(self, parser: ReasoningParser):
        self._start_tag = parser.start_tag
        self._end_tag = parser.end_tag
        self._untagged_phase = self._thinking if parser.starts_in_reasoning else self._answering
        self._buffer = ""
        self._reasoning = ""
        self._content = ""
        self._phase = self._opening

    def feed(self, delta_text: str) -> tuple[str, str]:
        self._buffer += delta_text
        return self._drain(final=False)

    def finish(self) -> tuple[str, str]:
        """Flush what was held back at the end of the completion."""
        return self._drain(final=True)

    def _drain(self, final: bool) -> tuple[str, str]:
        self._reasoning = self._content = ""
        while self._buffer and self._phase(final):
            pass
        return self._reasoning, self._content

    def _opening(self, final: bool) -> bool:
        opened = self._buffer.lstrip()
        if opened.startswith(self._start_tag):
            self._buffer = opened[len(self._start_tag):]
            self._phase = self._thinking
        elif self._start_tag.startswith(opened) and not final:
            return False  # "", "<thi": cannot tell yet
        else:
            self._phase = self._untagged_phase
        return True

    def _thinking(self, final: bool) -> bool:
        end = self._buffer.find(self._end_tag)
        if end < 0:
            keep = 0 if final else partial_tag_len(self._buffer, self._end_tag)
            self._reasoning += self._buffer[:len(self._buffer) - keep]
            self._buffer = self._buffer[len(self._buffer) - keep:]
            return False
        self._reasoning += self._buffer[:end]
        self._buffer = self._buffer[end + len(self._end_tag):]
        self._phase = self._answering
        return True

    def _answering(self, final: bool) -> bool:
        self._content += self._buffer
        self._buffer = ""
        return False
