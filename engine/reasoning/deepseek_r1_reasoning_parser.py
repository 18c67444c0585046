"""DeepSeek-R1: the chat template opens `<think>` in the prompt, so the completion starts thinking.

Text before the first `</think>` is reasoning (a leading `<think>`, which older templates left to
the model, is dropped); the rest is content. No `</think>` at all: all reasoning (the model ran
out of tokens while thinking).
"""
from __future__ import annotations

from engine.reasoning.abs_reasoning_parser import ReasoningParser


class DeepSeekR1ReasoningParser(ReasoningParser):
    starts_in_reasoning = True
