"""Reasoning parsers: `<think>` text to `reasoning_content`, chosen by name as vLLM's --reasoning-parser.

No torch here (the HTTP tier imports this package).
"""
from __future__ import annotations

from engine.reasoning.abs_reasoning_parser import ReasoningParser, ReasoningStreamer
from engine.reasoning.deepseek_r1_reasoning_parser import DeepSeekR1ReasoningParser
from engine.reasoning.qwen3_reasoning_parser import Qwen3ReasoningParser

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "qwen3": Qwen3ReasoningParser,
}


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(
            f"unknown reasoning parser {name!r}; choose one of: {', '.join(sorted(REASONING_PARSERS))}"
        ) from None


__all__ = [
    "REASONING_PARSERS",
    "DeepSeekR1ReasoningParser",
    "Qwen3ReasoningParser",
    "ReasoningParser",
    "ReasoningStreamer",
    "get_reasoning_parser",
]
