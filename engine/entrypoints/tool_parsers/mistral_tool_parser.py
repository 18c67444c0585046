"""Mistral tool calls: `[TOOL_CALLS]` then the calls, in one of the two shapes its tokenizers use.

- before v11: a JSON list, `[TOOL_CALLS] [{"name": "f", "arguments": {...}}, ...]`
- v11 and later: `[TOOL_CALLS]f[ARGS]{...}`, the marker repeated before each call

Text before `[TOOL_CALLS]` (and after the calls) is content. A list is all calls or none: if any
element is not a valid call, the marker and the list stay content, verbatim. So do a v11 name
that is not followed by `[ARGS]` and a JSON object, and a marker at the end of the text.

`[TOOL_CALLS]` is a special (control) token in Mistral's tokenizers: the detokenizer must keep
special tokens (skip_special_tokens=False) for it to reach this parser, as in vLLM.

Call ids are 9 alphanumerics, as vLLM's MistralToolCall makes them: Mistral's chat templates
refuse any other id when the client sends the calls back in the conversation history.
"""
from __future__ import annotations

import re
import secrets
import string

from engine.entrypoints.tool_parsers.abs_tool_parser import ToolParser, ToolStreamer
from engine.entrypoints.tool_parsers.utils import (
    NotACall,
    arguments_text,
    call_from_json,
    find_json_end,
    load_json,
    skip_space,
    wait_unless_final,
)

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
_NAME = re.compile(r"[\w.\-]*")


def make_mistral_tool_call_id() -> str:
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


class MistralToolStreamer(ToolStreamer):

    def _new_call_id(self) -> str:
        return make_mistral_tool_call_id()

    def _in_text(self, final: bool) -> bool:
        if not self._emit_text_before(TOOL_CALLS, final):
            return False
        self._phase = self._in_calls
        return True

    def _in_calls(self, final: bool) -> bool:
        """The buffer starts with [TOOL_CALLS]: take its calls, wait, or give the marker back."""
        return self._take_after(TOOL_CALLS, self._take_calls, final)

    def _take_calls(self, final: bool) -> int | None:
        """Emit the calls after the marker and return where they end; None: wait for more."""
        start = skip_space(self._buffer, len(TOOL_CALLS))
        if start == len(self._buffer):
            return wait_unless_final(final)
        if self._buffer[start] == "[":
            return self._take_list(start, final)
        return self._take_named_call(start, final)

    def _take_list(self, start: int, final: bool) -> int | None:
        end = find_json_end(self._buffer, start)
        if end is None:
            return wait_unless_final(final)
        items = load_json(self._buffer[start:end])
        calls = [call_from_json(item) for item in items] if isinstance(items, list) else [None]
        if not calls or None in calls:
            raise NotACall
        for call in calls:
            self._emit_call(*call)
        return end

    def _take_named_call(self, start: int, final: bool) -> int | None:
        """v11: `name[ARGS]{...}` at start."""
        name_end = _NAME.match(self._buffer, start).end()
        after_name = self._buffer[name_end:]
        if name_end == start or not (after_name.startswith(ARGS) or ARGS.startswith(after_name)):
            raise NotACall
        json_start = name_end + len(ARGS)
        if json_start >= len(self._buffer):
            return wait_unless_final(final)
        if self._buffer[json_start] != "{":
            raise NotACall
        json_end = find_json_end(self._buffer, json_start)
        if json_end is None:
            return wait_unless_final(final)
        call = arguments_text(self._buffer[start:name_end], load_json(self._buffer[json_start:json_end]))
        if call is None:
            raise NotACall
        self._emit_call(*call)
        return json_end


class MistralToolParser(ToolParser):
    streamer_cls = MistralToolStreamer
