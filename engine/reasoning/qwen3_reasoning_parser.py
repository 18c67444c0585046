"""Qwen3 (hybrid thinking): the completion itself opens `<think>`, thinks, closes `</think>`, answers.

A completion that does not open with `<think>` (after whitespace) is all answer: thinking was
off (enable_thinking=False puts an empty think block in the prompt) or the checkpoint does not
think. Deciding at the opening is what lets such answers stream at once. An open `<think>`
that never closes is unfinished thinking: all reasoning.

Checkpoints whose template opens `<think>` in the prompt (Qwen3-*-Thinking-2507, Qwen3.5) emit
only `</think>`: use `deepseek_r1` for them, as vLLM's docs advise for the Thinking-2507 models.
"""
from __future__ import annotations

from engine.reasoning.abs_reasoning_parser import ReasoningParser


class Qwen3ReasoningParser(ReasoningParser):
    starts_in_reasoning = False
