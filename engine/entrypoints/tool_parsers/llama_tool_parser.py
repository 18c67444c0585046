"""Llama 3.1 / 3.2 / 3.3 JSON tool calls: the reply is `{"name": ..., "parameters": {...}}`.

Optionally after `<|python_tag|>`, several calls separated by `;` ("arguments" is accepted for
"parameters"). Calls are recognised only where Llama's prompt format puts them, at the start
of the reply (after whitespace): a reply that opens with anything else is content, so plain
answers stream at once instead of waiting to see whether JSON comes later. (vLLM's non-streaming
path searches the whole text, its streaming path only the start; we take the start for both.)

If the first object is not a valid call (bad JSON, no string name, arguments not an object),
the whole reply is content, verbatim. After one or more calls, text that is not `; <call>`
ends the calls and is content (the whitespace before it dropped).

Note that `<|python_tag|>` is a special token: with skip_special_tokens it never reaches the
text, which is fine, as the tag is optional here.
"""
from __future__ import annotations

import re

from engine.entrypoints.tool_parsers.abs_tool_parser import ToolParser, ToolStreamer
from engine.entrypoints.tool_parsers.utils import (
    NotACall,
    call_from_json,
    find_json_end,
    load_json,
    skip_space,
    wait_unless_final,
)

PYTHON_TAG = "<|python_tag|>"
_ARGS_KEYS = ("parameters", "arguments")
_SEPARATOR = re.compile(r"\s*;\s*")


class Llama3JsonToolStreamer(ToolStreamer):

    def __init__(self):
        super().__init__()
        self._phase = self._opening

    def _opening(self, final: bool) -> bool:
        """Before anything is decided: does the reply open with a call?"""
        head = self._buffer.lstrip()
        if head.startswith((PYTHON_TAG, "{")):
            self._phase = self._first_call
            return True
        if PYTHON_TAG.startswith(head) and not final:
            return False  # "", "<|pyth": cannot tell yet
        self._phase = self._in_text
        return True

    def _in_text(self, final: bool) -> bool:
        self._emit_content(self._buffer)
        self._buffer = ""
        return False

    def _first_call(self, final: bool) -> bool:
        json_start = skip_space(self._buffer, 0)
        if self._buffer.startswith(PYTHON_TAG, json_start):
            json_start = skip_space(self._buffer, json_start + len(PYTHON_TAG))
        return self._take_call(json_start, final, content_from=0)

    def _after_call(self, final: bool) -> bool:
        """After a call: `; <call>` continues, whitespace then the end finishes, else content."""
        text_start = skip_space(self._buffer, 0)
        if text_start == len(self._buffer):
            if final:
                self._buffer = ""  # whitespace after the last call only ends it
            return False
        separator = _SEPARATOR.match(self._buffer, text_start)
        if separator is None:
            return self._give_up(text_start)
        return self._take_call(separator.end(), final, content_from=text_start)

    def _take_call(self, json_start: int, final: bool, content_from: int) -> bool:
        """Take the call whose JSON starts at json_start; if it is not one, content from content_from."""
        try:
            json_end = self._call_json_end(json_start, final)
            if json_end is None:
                return False
            call = call_from_json(load_json(self._buffer[json_start:json_end]), _ARGS_KEYS)
            if call is None:
                raise NotACall
        except NotACall:
            return self._give_up(content_from)
        self._emit_call(*call)
        self._buffer = self._buffer[json_end:]
        self._phase = self._after_call
        return True

    def _call_json_end(self, json_start: int, final: bool) -> int | None:
        if json_start == len(self._buffer):
            return wait_unless_final(final)
        if self._buffer[json_start] != "{":
            raise NotACall
        json_end = find_json_end(self._buffer, json_start)
        return wait_unless_final(final) if json_end is None else json_end

    def _give_up(self, content_from: int) -> bool:
        """No (more) calls: the rest of the reply, from content_from, is content."""
        self._buffer = self._buffer[content_from:]
        self._phase = self._in_text
        return True


class Llama3JsonToolParser(ToolParser):
    streamer_cls = Llama3JsonToolStreamer
