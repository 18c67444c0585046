"""Server-sent events of the OpenAI streaming APIs, parsed one line at a time.

A stream is `data: <json>` lines separated by blank lines and ended by
`data: [DONE]`; lines starting with `:` are keep-alive comments. The last JSON
chunk carries `usage` (with `stream_options.include_usage`) and no choices.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

DONE = "[DONE]"


@dataclass
class StreamChunk:
    """What one `data:` line says about the generation."""

    text: str = ""                       # generated text in this chunk ("" for role/usage/finish chunks)
    finish_reason: str | None = None
    completion_tokens: int | None = None  # from the usage chunk
    prompt_tokens: int | None = None      # from the usage chunk
    cached_tokens: int | None = None      # the usage's prompt_tokens_details.cached_tokens (prefix-cache hits)
    error: str | None = None             # an error object sent mid-stream


def sse_data(line: str) -> str | None:
    """The payload of a `data:` line; None for blank lines, comments and other fields."""
    if not line.startswith("data:"):
        return None
    payload = line[5:]
    return payload[1:] if payload.startswith(" ") else payload  # one optional space, per the SSE spec


def parse_chunk(payload: str, endpoint: str) -> StreamChunk:
    """One JSON chunk of the `completions` or `chat` endpoint; `[DONE]` must be handled before."""
    try:
        obj = json.loads(payload)
    except json.JSONDecodeError:
        return StreamChunk(error=f"malformed chunk: {payload[:200]!r}")
    if not isinstance(obj, dict):
        return StreamChunk(error=f"chunk is not an object: {payload[:200]!r}")
    if "error" in obj:
        err = obj["error"]
        return StreamChunk(error=str(err.get("message", err)) if isinstance(err, dict) else str(err))
    chunk = StreamChunk()
    usage = obj.get("usage")
    if isinstance(usage, dict):
        if usage.get("completion_tokens") is not None:
            chunk.completion_tokens = int(usage["completion_tokens"])
        if usage.get("prompt_tokens") is not None:
            chunk.prompt_tokens = int(usage["prompt_tokens"])
            details = usage.get("prompt_tokens_details") or {}  # absent: nothing came from a cache
            chunk.cached_tokens = int(details.get("cached_tokens") or 0)
    choices = obj.get("choices") or []
    if choices:
        choice = choices[0]
        text = choice.get("text") if endpoint == "completions" else (choice.get("delta") or {}).get("content")
        chunk.text = text or ""
        chunk.finish_reason = choice.get("finish_reason")
    return chunk
