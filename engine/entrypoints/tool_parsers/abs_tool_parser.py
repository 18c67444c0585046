"""The tool-call parser interface: what a completion's text becomes in OpenAI's `tool_calls`.

A parser turns model text into content plus calls, once (`extract`) or over text deltas
(`streamer().feed(...)` then `finish()`). `extract` runs the streamer on the whole text, so the
two can never disagree; the streamers are written so that how the text is split into deltas
does not change what comes out (tests/test_tool_parsers.py feeds every split).

Streaming holds a call back until it is complete and valid, then sends it as two deltas (index,
id and name; then the whole arguments), rather than streaming argument fragments: a call that
turns out malformed is then still content, never a half-sent call that must be taken back.

Whitespace that only separates calls (from each other, or from the start or end of the text) is
dropped; any other text outside calls is content, verbatim.
"""
from __future__ import annotations

import secrets
import string
from dataclasses import dataclass, field

from engine.entrypoints.tool_parsers.utils import NotACall, partial_tag_len

_ID_ALPHABET = string.ascii_letters + string.digits


def make_tool_call_id() -> str:
    """OpenAI's shape: "call_" and 24 random alphanumerics."""
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text of the arguments object, as OpenAI's function.arguments
    id: str = field(default_factory=make_tool_call_id)


@dataclass
class ExtractedToolCalls:
    content: str | None  # the text that is not a call; None when empty
    tool_calls: list[ToolCall]


@dataclass
class ToolCallDelta:
    index: int               # position of the call in the completion's tool_calls
    id: str | None = None    # set on the call's first delta only
    name: str | None = None  # set on the call's first delta only
    arguments: str = ""      # a fragment of function.arguments


@dataclass
class StreamDelta:
    content: str = ""  # new content text (may be "")
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class ToolStreamer:
    """Turns text deltas into content and tool-call deltas for one completion.

    A subclass is a small state machine: `self._phase` is the current state, a method that looks
    at `self._buffer` (text received, not yet decided), moves what is decided out of it with
    `_emit_content` / `_emit_call`, may switch `self._phase`, and returns True to be called
    again or False to wait for more text. On `finish` (final=True) nothing may be waited for.
    """

    def __init__(self):
        self._buffer = ""
        self._num_calls = 0
        self._pending_space = ""  # whitespace since the last call, kept until we know it borders text
        self._segment_has_text = False  # the text since the last call holds more than whitespace
        self._delta = StreamDelta()
        self._phase = self._in_text

    def feed(self, delta_text: str) -> StreamDelta:
        self._buffer += delta_text
        return self._drain(final=False)

    def finish(self) -> StreamDelta:
        """Flush at the end of the completion: held text that never became a call is content."""
        delta = self._drain(final=True)
        if self._num_calls == 0:  # whitespace-only output borders no call: it stays
            delta.content += self._pending_space
        self._pending_space = ""
        return delta

    def _drain(self, final: bool) -> StreamDelta:
        self._delta = StreamDelta()
        while self._buffer and self._phase(final):
            pass
        return self._delta

    def _in_text(self, final: bool) -> bool:
        raise NotImplementedError

    def _emit_text_before(self, tag: str, final: bool) -> bool:
        """Emit the buffer as content up to the first `tag`; True when the buffer now starts with it.

        A suffix that may be the start of `tag` ("<tool_c") is held back until the text tells.
        """
        start = self._buffer.find(tag)
        if start < 0:
            start = len(self._buffer) - (0 if final else partial_tag_len(self._buffer, tag))
        self._emit_content(self._buffer[:start])
        self._buffer = self._buffer[start:]
        return self._buffer.startswith(tag)

    def _take_after(self, marker: str, take, final: bool) -> bool:
        """The buffer starts with `marker`: `take(final)` emits what follows and returns where it
        ends (None: wait for more), or raises NotACall, and the marker is given back as content.
        Then back to text."""
        try:
            end = take(final)
        except NotACall:
            self._emit_content(marker)
            end = len(marker)
        if end is None:
            return False
        self._buffer = self._buffer[end:]
        self._phase = self._in_text
        return True

    def _new_call_id(self) -> str:
        return make_tool_call_id()

    def _emit_content(self, text: str) -> None:
        if not self._segment_has_text:
            # Whitespace is held until non-whitespace follows: it is dropped if a call comes first.
            stripped = text.lstrip()
            if not stripped:
                self._pending_space += text
                return
            text, self._pending_space = self._pending_space + text, ""
            self._segment_has_text = True
        self._delta.content += text

    def _emit_call(self, name: str, arguments: str) -> None:
        index = self._num_calls
        self._delta.tool_calls.append(ToolCallDelta(index=index, id=self._new_call_id(), name=name))
        self._delta.tool_calls.append(ToolCallDelta(index=index, arguments=arguments))
        self._num_calls += 1
        self._pending_space = ""  # whitespace before a call only separated it
        self._segment_has_text = False


def extracted_from_deltas(deltas: list[StreamDelta]) -> ExtractedToolCalls:
    """Assemble stream deltas as a client does: content joined, each call's fragments by index."""
    calls: list[ToolCall] = []
    for delta in deltas:
        for part in delta.tool_calls:
            if part.index == len(calls):
                calls.append(ToolCall(name=part.name, arguments="", id=part.id))
            calls[part.index].arguments += part.arguments
    content = "".join(delta.content for delta in deltas)
    return ExtractedToolCalls(content=content or None, tool_calls=calls)


class ToolParser:
    """One model family's tool-call format; `streamer_cls` does the work."""

    streamer_cls: type[ToolStreamer] = ToolStreamer

    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer  # unused by the text-level formats here; kept for vLLM's signature

    def extract(self, text: str) -> ExtractedToolCalls:
        streamer = self.streamer()
        return extracted_from_deltas([streamer.feed(text), streamer.finish()])

    def streamer(self) -> ToolStreamer:
        return self.streamer_cls()
