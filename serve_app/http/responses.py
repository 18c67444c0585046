"""Engine deltas -> OpenAI response bodies and stream chunks (plain dicts: cheaper than models per token).

A builder is fed the StreamItems of a request's engine streams (prompt p, completion j
-> choice p * n + j, as OpenAI and vLLM number them) and either returns the chunks to
send now (streaming) or, at the end, the whole body (non-streaming). Pure: tested without Ray.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

from serve_app.http.messages import Delta, OutputSpec, StreamItem, TokenLogprob, ToolCall
from serve_app.http.output_parser import ChoiceParser

_MIN_LOGPROB = -9999.0  # JSON has no -inf


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    logprobs: list[list[TokenLogprob]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    started: bool = False   # streaming: the first chunk (role / echo) has been sent
    text_offset: int = 0    # completions logprobs: characters before the next token
    reasoning: list[str] = field(default_factory=list)        # chat: the reasoning, apart from the text
    tool_calls: list[ToolCall] = field(default_factory=list)  # chat: validated calls
    parser: ChoiceParser | None = None  # chat: reads the text the guardrail did not (Delta.parsed)


class ResponseBuilder:
    object_name = ""
    chunk_object_name = ""

    def __init__(self, request_id: str, model: str, n: int, num_prompts: int, logprobs: int | None,
                 include_usage: bool = False):
        self.id, self.model, self.n = request_id, model, n
        self.created = int(time.time())
        self.logprobs = logprobs
        self.include_usage = include_usage
        self.choices = [_Choice() for _ in range(n * num_prompts)]
        self.prompt_tokens = [0] * num_prompts
        self.cached_tokens = [0] * num_prompts
        self.prompt_logprobs: list[list[list[TokenLogprob]] | None] = [None] * num_prompts  # per prompt, echo

    def add(self, prompt_index: int, item: StreamItem, stream: bool = False) -> list[dict[str, Any]]:
        """Record an item; when streaming, return the chunks to send for it."""
        self.prompt_tokens[prompt_index] = item.num_prompt_tokens
        self.cached_tokens[prompt_index] = item.num_cached_tokens
        if item.prompt_logprobs is not None:
            self.prompt_logprobs[prompt_index] = item.prompt_logprobs
        chunks = []
        for d in item.deltas:
            index = prompt_index * self.n + d.index
            choice = self.choices[index]
            d = self._read(choice, d)
            choice.text.append(d.text)
            choice.reasoning.append(d.reasoning)
            choice.tool_calls.extend(d.tool_calls or ())
            choice.num_tokens += len(d.token_ids)
            if d.finish_reason is not None:
                choice.finish_reason, choice.stop_reason = d.finish_reason, d.stop_reason
            if stream:
                chunks.extend(self._chunks(index, choice, d))
            elif d.logprobs:
                choice.logprobs.extend(d.logprobs)
        return chunks

    def usage(self) -> dict[str, Any]:
        prompt = sum(self.prompt_tokens)
        completion = sum(c.num_tokens for c in self.choices)
        usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
        if any(self.cached_tokens):
            usage["prompt_tokens_details"] = {"cached_tokens": sum(self.cached_tokens)}
        return usage

    def usage_chunk(self) -> dict[str, Any]:
        return self._envelope([], usage=self.usage())

    def _envelope(self, choices: list[dict], usage: Any = None, stream: bool = True) -> dict[str, Any]:
        body = {"id": self.id, "object": self.chunk_object_name if stream else self.object_name,
                "created": self.created, "model": self.model, "choices": choices}
        if not stream or self.include_usage:
            body["usage"] = usage
        return body

    def _read(self, choice: _Choice, d: Delta) -> Delta:
        """The delta as the response reports it (ChatBuilder: reasoning and content apart)."""
        return d

    def _chunks(self, index: int, choice: _Choice, d: Delta) -> list[dict[str, Any]]:
        raise NotImplementedError


class CompletionBuilder(ResponseBuilder):
    object_name = chunk_object_name = "text_completion"

    def __init__(self, *args, echo_texts: list[str] | None = None, echo_first_tokens: list[str] | None = None,
                 **kwargs):
        super().__init__(*args, **kwargs)
        self.echo_texts = echo_texts  # per prompt, when echo is on
        self.echo_first_tokens = echo_first_tokens  # per prompt, its first token's text: echo + logprobs

    def _prefix(self, index: int) -> str:
        return self.echo_texts[index // self.n] if self.echo_texts else ""

    def _chunks(self, index: int, choice: _Choice, d: Delta) -> list[dict[str, Any]]:
        text, first = d.text, not choice.started
        if first:
            choice.started = True
            prefix = self._prefix(index)
            choice.text_offset = len(prefix)
            text = prefix + text
        if not text and not d.finish_reason and not d.logprobs:
            return []
        logprobs = None
        if self.logprobs is not None:
            logprobs = self._legacy_logprobs(choice, d.logprobs)
            if first:  # the echoed prompt's tokens come with the echoed text
                logprobs = self._with_prompt_logprobs(index, logprobs)
        return [self._envelope([{"index": index, "text": text, "logprobs": logprobs,
                                 "finish_reason": d.finish_reason, "stop_reason": d.stop_reason}])]

    def _legacy_logprobs(self, choice: _Choice, entries: list[list[TokenLogprob]] | None) -> dict[str, list]:
        """OpenAI's legacy completions format: parallel lists, one element per token."""
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for entry in entries or ():
            _tid, lp, _rank, token = entry[0]
            out["tokens"].append(token)
            out["token_logprobs"].append(max(lp, _MIN_LOGPROB))
            out["top_logprobs"].append({t: max(p, _MIN_LOGPROB) for _i, p, _r, t in entry})
            out["text_offset"].append(choice.text_offset)
            choice.text_offset += len(token)
        return out

    def _with_prompt_logprobs(self, index: int, completion: dict[str, list]) -> dict[str, list]:
        """Echo + logprobs: the prompt's tokens, then the completion's, as OpenAI. The first prompt
        token has no logprob (null). Prompt offsets count back from the end of the echoed text, so a
        BOS token the text does not show gets offset 0 instead of shifting every later offset.

        (Without this choice's prompt logprobs yet, which only a preempted n > 1 request can
        produce, the prompt part is left out.)
        """
        p = index // self.n
        entries = self.prompt_logprobs[p]
        if not self.echo_first_tokens or entries is None:
            return completion
        tokens = [self.echo_first_tokens[p]] + [e[0][3] for e in entries]
        offsets, end = [], len(self._prefix(index))
        for token in reversed(tokens):
            end -= len(token)
            offsets.append(max(end, 0))
        return {"tokens": tokens + completion["tokens"],
                "token_logprobs": [None] + [max(e[0][1], _MIN_LOGPROB) for e in entries] + completion["token_logprobs"],
                "top_logprobs": [None] + [{t: max(lp, _MIN_LOGPROB) for _i, lp, _r, t in e} for e in entries]
                + completion["top_logprobs"],
                "text_offset": offsets[::-1] + completion["text_offset"]}

    def final(self) -> dict[str, Any]:
        choices = []
        for index, c in enumerate(self.choices):
            prefix = self._prefix(index)
            logprobs = None
            if self.logprobs is not None:
                c.text_offset = len(prefix)
                logprobs = self._with_prompt_logprobs(index, self._legacy_logprobs(c, c.logprobs))
            choices.append({"index": index, "text": prefix + "".join(c.text), "logprobs": logprobs,
                            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        return self._envelope(choices, usage=self.usage(), stream=False)


class ChatBuilder(ResponseBuilder):
    """Chat bodies and chunks. With an OutputSpec (a chat request on a server with a reasoning
    parser, or with tools) the reply carries `reasoning_content` and `tool_calls` apart from
    `content`: as the guardrail read them, or read here when the completion bypassed it."""

    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def __init__(self, *args, output: OutputSpec | None = None, include_reasoning: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self.reasoning = output is not None and output.reasoning_parser is not None and include_reasoning
        if output is not None:
            for choice in self.choices:
                choice.parser = ChoiceParser(output)

    def _read(self, choice: _Choice, d: Delta) -> Delta:
        if d.parsed or choice.parser is None:
            return d
        part = choice.parser.feed(d.text)
        if d.finish_reason is not None:
            part += choice.parser.finish()
        return dataclasses.replace(d, text=part.content, reasoning=part.reasoning,
                                   tool_calls=part.tool_calls or None, parsed=True)

    def _chunks(self, index: int, choice: _Choice, d: Delta) -> list[dict[str, Any]]:
        chunks = []
        if not choice.started:
            # OpenAI's first chunk of a choice is the role, no content yet. Every choice's, in index
            # order, before any other: the openai client's stream helper takes its list of choices
            # from the first chunk and fails on a first chunk of choice 1 (n > 1).
            for i, c in enumerate(self.choices):
                if not c.started:
                    c.started = True
                    chunks.append(self._envelope([{"index": i, "delta": {"role": "assistant", "content": ""},
                                                   "logprobs": None, "finish_reason": None}]))
        deltas = []
        text = {"content": d.text} if d.text else {}
        if d.reasoning and self.reasoning:
            text = {"reasoning_content": d.reasoning, **text}
        if text or d.logprobs:
            deltas.append(text)
        first_call = len(choice.tool_calls) - len(d.tool_calls or ())
        for k, call in enumerate(d.tool_calls or (), start=first_call):
            deltas.extend(_tool_call_deltas(k, call))
        if d.finish_reason and not deltas:
            deltas.append({})
        logprobs = self._chat_logprobs(d.logprobs) if self.logprobs is not None else None
        for i, delta in enumerate(deltas):  # logprobs with the first, the finish reason on the last
            last = i == len(deltas) - 1
            chunks.append(self._envelope([{
                "index": index, "delta": delta, "logprobs": logprobs if i == 0 else None,
                "finish_reason": _finish_reason(choice, d.finish_reason) if last else None,
                "stop_reason": d.stop_reason if last else None}]))
        return chunks

    def _chat_logprobs(self, entries: list[list[TokenLogprob]] | None) -> dict[str, list]:
        k = self.logprobs or 0
        content = []
        for entry in entries or ():
            _tid, lp, _rank, token = entry[0]
            top = sorted((e for e in entry if e[2] is not None and e[2] <= k), key=lambda e: e[2])[:k]
            content.append({"token": token, "logprob": max(lp, _MIN_LOGPROB), "bytes": list(token.encode()),
                            "top_logprobs": [{"token": t, "logprob": max(p, _MIN_LOGPROB), "bytes": list(t.encode())}
                                             for _i, p, _r, t in top]})
        return {"content": content}

    def final(self) -> dict[str, Any]:
        choices = []
        for index, c in enumerate(self.choices):
            logprobs = self._chat_logprobs(c.logprobs) if self.logprobs is not None else None
            choices.append({"index": index, "message": self._message(c), "logprobs": logprobs,
                            "finish_reason": _finish_reason(c, c.finish_reason), "stop_reason": c.stop_reason})
        return self._envelope(choices, usage=self.usage(), stream=False)

    def _message(self, c: _Choice) -> dict[str, Any]:
        content = "".join(c.text)
        message: dict[str, Any] = {"role": "assistant", "content": content or (None if c.tool_calls else "")}
        if self.reasoning:
            message["reasoning_content"] = "".join(c.reasoning) or None
        if c.tool_calls:
            message["tool_calls"] = [{"id": call.id, "type": "function",
                                      "function": {"name": call.name, "arguments": call.arguments}}
                                     for call in c.tool_calls]
        return message


def _tool_call_deltas(index: int, call: ToolCall) -> list[dict[str, Any]]:
    """OpenAI's streamed call: index, id, type and name first, then the arguments."""
    return [{"tool_calls": [{"index": index, "id": call.id, "type": "function",
                             "function": {"name": call.name, "arguments": ""}}]},
            {"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]}]


def _finish_reason(choice: _Choice, finish_reason: str | None) -> str | None:
    """"tool_calls" when the model stopped after calling tools (OpenAI's)."""
    return "tool_calls" if finish_reason == "stop" and choice.tool_calls else finish_reason
