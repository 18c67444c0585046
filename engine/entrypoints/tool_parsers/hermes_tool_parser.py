"""Hermes / Qwen2.5 / Qwen3 tool calls: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`.

Calls may repeat; text before, between and after them is content. The JSON's end is found by
bracket matching that skips strings, so `</tool_call>` or braces inside an argument value do
not end the call early.

Not a call, so content verbatim (the `<tool_call>` tag included): a body that is not one JSON
object, bad JSON, no string name, arguments that are not an object, or anything but whitespace
between the object and `</tool_call>`. A missing `arguments` means `{}`.

An unclosed `<tool_call>` at the end of the completion whose JSON object is complete (only
whitespace after it) is a call, as in vLLM: the model said everything but the closing tag
(e.g. it hit max_tokens or a stop string there). With incomplete JSON it is content.
"""
from __future__ import annotations

from engine.entrypoints.tool_parsers.abs_tool_parser import ToolParser, ToolStreamer
from engine.entrypoints.tool_parsers.utils import (
    NotACall,
    call_from_json,
    find_json_end,
    load_json,
    skip_space,
    wait_unless_final,
)

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"


class HermesToolStreamer(ToolStreamer):

    def _in_text(self, final: bool) -> bool:
        if not self._emit_text_before(TOOL_CALL_START, final):
            return False
        self._phase = self._in_call
        return True

    def _in_call(self, final: bool) -> bool:
        """The buffer starts with <tool_call>: take one call, wait, or give the tag back as content."""
        return self._take_after(TOOL_CALL_START, self._take_call, final)

    def _take_call(self, final: bool) -> int | None:
        """Emit the call at the start of the buffer and return where it ends; None: wait for more."""
        text = self._buffer
        json_start = skip_space(text, len(TOOL_CALL_START))
        if json_start < len(text) and text[json_start] != "{":
            raise NotACall
        json_end = find_json_end(text, json_start) if json_start < len(text) else None
        if json_end is None:
            return wait_unless_final(final)
        tail_start = skip_space(text, json_end)
        tail = text[tail_start:]
        if tail.startswith(TOOL_CALL_END):
            end = tail_start + len(TOOL_CALL_END)
        elif not TOOL_CALL_END.startswith(tail) or (final and tail):
            raise NotACall  # other text after the JSON, or the completion ended inside the tag
        elif not final:
            return None
        else:
            end = len(text)  # unclosed but complete: a call (see the module docstring)
        call = call_from_json(load_json(text[json_start:json_end]))
        if call is None:
            raise NotACall
        self._emit_call(*call)
        return end


class HermesToolParser(ToolParser):
    streamer_cls = HermesToolStreamer
