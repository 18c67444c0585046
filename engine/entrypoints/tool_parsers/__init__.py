"""Tool-call parsers: model text to OpenAI `tool_calls`, chosen by name as vLLM's --tool-call-parser.

No torch here (the HTTP tier imports this package). See abs_tool_parser.py for the interface and
the rules every parser keeps (streaming equals non-streaming; malformed calls stay content).
"""
from __future__ import annotations

from engine.entrypoints.tool_parsers.abs_tool_parser import (
    ExtractedToolCalls,
    StreamDelta,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    ToolStreamer,
    extracted_from_deltas,
    make_tool_call_id,
)
from engine.entrypoints.tool_parsers.hermes_tool_parser import HermesToolParser
from engine.entrypoints.tool_parsers.llama_tool_parser import Llama3JsonToolParser
from engine.entrypoints.tool_parsers.mistral_tool_parser import MistralToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
}


def get_tool_parser(name: str) -> type[ToolParser]:
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(
            f"unknown tool call parser {name!r}; choose one of: {', '.join(sorted(TOOL_PARSERS))}"
        ) from None


__all__ = [
    "TOOL_PARSERS",
    "ExtractedToolCalls",
    "HermesToolParser",
    "Llama3JsonToolParser",
    "MistralToolParser",
    "StreamDelta",
    "ToolCall",
    "ToolCallDelta",
    "ToolParser",
    "ToolStreamer",
    "extracted_from_deltas",
    "get_tool_parser",
    "make_tool_call_id",
]
