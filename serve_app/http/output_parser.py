"""One chat completion's text read as it streams: reasoning, then content, in which calls are found.

    model text --reasoning parser (app arg reasoning_parser)--> reasoning | answer
    answer     --tool-call parser (tool_choice "auto": app arg tool_call_parser)--> content | calls

Both parsers are the engine's (engine/reasoning, engine/entrypoints/tool_parsers), small state
machines over text deltas whose output does not depend on how the text was split. The guardrail
reads every completion it checks with a ChoiceParser (it validates the answer, never the
reasoning); the Ingress reads, with one of its own, the completions that bypass the guardrail
(a plain chat on a reasoning model). Pure: tested without Ray.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.entrypoints.tool_parsers import get_tool_parser
from engine.reasoning import get_reasoning_parser
from serve_app.http.messages import OutputSpec, ToolCall


@dataclass
class ParsedText:
    """What a piece of the text turned out to be."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)  # complete calls (arguments not yet checked)

    def __iadd__(self, other: "ParsedText") -> "ParsedText":
        self.reasoning += other.reasoning
        self.content += other.content
        self.tool_calls.extend(other.tool_calls)
        return self


class ChoiceParser:
    def __init__(self, spec: OutputSpec):
        self._reasoning = None
        if spec.reasoning_parser is not None:
            self._reasoning = get_reasoning_parser(spec.reasoning_parser)().streamer()
        self._tools = None
        if spec.tools is not None and spec.tools.choice == "auto":
            self._tools = get_tool_parser(spec.tools.parser)().streamer()

    def feed(self, text: str) -> ParsedText:
        if self._reasoning is None:
            return self._answer(text, final=False)
        reasoning, answer = self._reasoning.feed(text)
        return self._with_reasoning(reasoning, self._answer(answer, final=False))

    def finish(self) -> ParsedText:
        """The rest, at the end of the completion (text held back for a tag that never came)."""
        if self._reasoning is None:
            return self._answer("", final=True)
        reasoning, answer = self._reasoning.finish()
        return self._with_reasoning(reasoning, self._answer(answer, final=True))

    @staticmethod
    def _with_reasoning(reasoning: str, parsed: ParsedText) -> ParsedText:
        parsed.reasoning = reasoning
        return parsed

    def _answer(self, text: str, final: bool) -> ParsedText:
        if self._tools is None:
            return ParsedText(content=text)
        delta = self._tools.feed(text) if text else None
        parts = [delta] if delta is not None else []
        if final:
            parts.append(self._tools.finish())
        parsed = ParsedText()
        for part in parts:
            parsed.content += part.content
            # A streamer sends a call once it is complete, as two deltas of one feed: index, id and
            # name, then the whole arguments (engine/entrypoints/tool_parsers/abs_tool_parser.py).
            for call_delta in part.tool_calls:
                if call_delta.name is not None:
                    parsed.tool_calls.append(ToolCall(call_delta.id, call_delta.name, ""))
                else:
                    parsed.tool_calls[-1].arguments += call_delta.arguments
        return parsed
