"""Text helpers shared by the tool-call parsers (and the reasoning parsers): no torch, stdlib only."""
from __future__ import annotations

import json
import re

# One JSON string (escapes included, so a quote or bracket inside it is skipped), or a run of
# characters that cannot open or close a container. An unterminated string matches neither.
_STRING_OR_PLAIN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[^"{}\[\]]+', re.DOTALL)
_OPENER_OF = {"}": "{", "]": "["}


class NotACall(Exception):
    """Raised inside a streamer when the text after a call marker is not a valid call."""


def wait_unless_final(final: bool) -> None:
    """None (wait for more text) while the completion goes on; at its end, a call still missing
    its text is not a call."""
    if final:
        raise NotACall


def skip_space(text: str, pos: int) -> int:
    """The first index at or after `pos` that is not whitespace (len(text) if none)."""
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`.

    A streamer holds that many characters back: "...</thi" may yet become "</think>".
    """
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def find_json_end(text: str, start: int) -> int | None:
    """Index just past the bracket that closes the container opening at `text[start]`.

    None while the text ends before it closes (a streamer waits for more). Braces and brackets
    inside strings do not count. A closer that does not match its opener ends the span at once:
    `json.loads` then rejects it, so the caller treats it as malformed without waiting.
    """
    stack = [text[start]]
    pos = start + 1
    while stack:
        if pos >= len(text):
            return None
        ch = text[pos]
        if ch in "{[":
            stack.append(ch)
            pos += 1
        elif ch in "}]":
            pos += 1
            if stack.pop() != _OPENER_OF[ch]:
                return pos
        else:
            match = _STRING_OR_PLAIN.match(text, pos)
            if match is None:  # a string still open at the end of the text
                return None
            pos = match.end()
    return pos


def load_json(text: str):
    """The JSON value in `text`, or None when it does not parse.

    strict=False lets raw newlines and tabs inside strings through (models write code that way);
    the value is re-serialised canonically, so what leaves the parser is always valid JSON.
    """
    try:
        return json.loads(text, strict=False)
    except ValueError:
        return None


def call_from_json(obj, args_keys: tuple[str, ...] = ("arguments",)) -> tuple[str, str] | None:
    """(name, arguments JSON text) of a call object `{"name": ..., "<args key>": {...}}`, or None.

    The name must be a non-empty string and the arguments an object; a call without arguments
    has `{}`. Other keys (e.g. Mistral's "id") are ignored.
    """
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    args_key = next((key for key in args_keys if key in obj), None)
    arguments = {} if args_key is None else obj[args_key]
    return arguments_text(name, arguments)


def arguments_text(name: str, arguments) -> tuple[str, str] | None:
    """(name, canonical JSON text of `arguments`) when `arguments` is an object, else None."""
    if not isinstance(arguments, dict):
        return None
    return name, json.dumps(arguments, ensure_ascii=False)
