"""One guarded request through the guardrail: what to generate, what to pass on, when to retry or fail.

Pure (no Ray, no I/O): `JsonGuard` (guardrails.py) makes the engine calls, feeds every engine
StreamItem to `GuardedRequest.feed`, and passes on what it returns.

    attempt 0   the request as sent: its n completions
    attempt k   only the completions that failed and may be retried: n = how many of them, the
                same prompt and batch id (a batched request: the same engine replica, whose prefix
                cache holds the prompt), the seed from `attempt_seed`

A chat completion's text is read as it comes (serve_app/http/output_parser.py: the reasoning, the
content, the calls a tool-call parser finds), and what is passed on is read already (`Delta.parsed`).
Each finished completion's answer is checked once against the request's contract
(serve_app/guard/contract.py: a JSON document, or tool calls whose arguments fit their tools'
schemas), and each check is one outcome (counted in /metrics as
`<prefix>_guardrail_outcomes_total{outcome, reason}`):

    passed    reason "none", or "redacted" when redact_patterns changed the document
    retried   it failed with <reason> and is generated again
    rejected  it failed with <reason> and may not be retried: the request ends with a 422

A completion is retried while it has attempts left (1 + policy.max_retries in all), the request
samples (greedy decoding would write the same tokens again), and none of it has reached the
client. Every completion must pass: the first rejected one ends the request at once (the other
completions still running are cancelled in the engine), and only failing ones are retried.

Holding back: for non-streaming requests, for streaming ones while redact_patterns are configured,
and for a forced tool call (its whole answer is the call), a completion is passed on only once it
has been validated, as one delta with the validated (redacted) content and calls: no unredacted
byte and no unchecked call is ever sent, and a violation can be retried. Otherwise (streaming, no
redaction) content and reasoning go out as they come, calls are held, and the answer is checked
when it ends; a violation then cannot be retried if the client has part of it, and the stream ends
with the error event.
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
from dataclasses import dataclass, field
from typing import Any

from serve_app.guard.contract import Checked, NamedToolContract, RequiredToolsContract, make_contract
from serve_app.guard.policy import GuardrailError, GuardrailPolicy
from serve_app.http.messages import Delta, EngineRequest, ErrorKind, OutputSpec, StreamError, StreamItem
from serve_app.http.output_parser import ChoiceParser, ParsedText

logger = logging.getLogger(f"ray.serve.{__name__}")  # under Serve's logger: in the replica logs


def attempt_seed(seed: int | None, attempt: int) -> int | None:
    """The sampling seed of an attempt: the client's own for the first, then one derived from it.

    Not `seed + attempt`: the engine seeds the j-th completion of a request with seed + j, so
    seed + 1 would write choice 1's text again. The first 63 bits of sha256("<seed>:<attempt>")
    instead: the retries of a seeded request are as reproducible as the request itself. Without
    a seed every attempt samples afresh.
    """
    if seed is None or attempt == 0:
        return seed
    digest = hashlib.sha256(f"{seed}:{attempt}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


@dataclass
class _GuardedChoice:
    """One of the request's n completions, across its attempts."""

    index: int                  # the client's choice index, 0..n-1
    spec: OutputSpec | None     # how its text is read (reasoning, tool calls); None: all of it is the answer
    attempts: int = 0           # generations of it validated so far
    sent: bool = False          # part of it has gone to the client: it can no longer be retried
    text: list[str] = field(default_factory=list)        # the current attempt's text so far
    token_ids: list[int] = field(default_factory=list)   # ... its tokens
    logprobs: list[Any] | None = None                    # ... their logprobs, when asked for
    parsed: ParsedText = field(default_factory=ParsedText)  # ... read: reasoning, content, calls
    parser: ChoiceParser | None = None

    def restart(self) -> None:
        self.text, self.token_ids, self.logprobs, self.parsed = [], [], None, ParsedText()
        self.parser = ChoiceParser(self.spec) if self.spec is not None else None

    def add(self, d: Delta) -> ParsedText:
        """Take a delta of the current attempt; what its text turned out to be."""
        self.text.append(d.text)
        self.token_ids.extend(d.token_ids)
        if d.logprobs is not None:
            self.logprobs = (self.logprobs or []) + d.logprobs
        part = self._read(d.text, final=d.finish_reason is not None)
        self.parsed += part
        return part

    def _read(self, text: str, final: bool) -> ParsedText:
        if self.parser is None:
            return ParsedText(content=text)
        part = self.parser.feed(text)
        if final:
            part += self.parser.finish()
        return part


class GuardedRequest:
    """The guardrail's state for one engine request (one prompt, n completions) with a contract."""

    def __init__(self, request: EngineRequest, policy: GuardrailPolicy):
        params = request.sampling_params
        self.contract = make_contract(request.output, params.structured_outputs)
        if self.contract is None:
            raise ValueError("GuardedRequest needs a request with a contract (a JSON form or tool calls)")
        self.request = request
        self.policy = policy  # fixed for the request's life, even if the deployment is reconfigured
        # Hold each completion until validated: when it is not streamed, when redaction may change
        # it, and when the answer becomes a call (a forced one: the whole answer is its arguments).
        # Otherwise content and reasoning stream as they come; calls are still held (below).
        self.hold = (not request.stream or bool(policy.redact_patterns)
                     or isinstance(self.contract, (NamedToolContract, RequiredToolsContract)))
        self.choices = [_GuardedChoice(i, request.output) for i in range(params.n)]
        self.outcomes: list[tuple[str, str]] = []  # (outcome, reason) per validation
        self.done = False                          # the last item (finished, or an error) is out
        self._attempt = -1
        self._pending = list(range(params.n))  # choices the next attempt generates
        self._targets: list[int] = []          # the attempt's completion j -> choice self._targets[j]
        self._num_prompt_tokens = 0            # of the first attempt: the client's usage
        self._num_cached_tokens = 0

    # -- driving the attempts ----------------------------------------------------------
    def next_attempt(self) -> EngineRequest | None:
        """The engine request of the next attempt, or None when there is none to make."""
        if self.done or not self._pending:
            return None
        self._attempt += 1
        self._targets, self._pending = self._pending, []
        for i in self._targets:
            self.choices[i].restart()
        params = self.request.sampling_params.clone()
        params.n = len(self._targets)
        params.seed = attempt_seed(self.request.sampling_params.seed, self._attempt)
        request_id = self.request.request_id
        if self._attempt:
            request_id = f"{request_id}-retry{self._attempt}"
            logger.debug("guardrail retry %d of %s: choices %s", self._attempt, self.request.request_id,
                         self._targets)
        return dataclasses.replace(self.request, request_id=request_id, sampling_params=params)

    def feed(self, item: StreamItem) -> StreamItem | None:
        """Take one engine item of the current attempt; return the item to pass on now, if any.

        The returned item is final (finished=True) when the request is done: all choices passed,
        one was rejected, or the engine failed; `done` is then set and nothing more is fed.
        """
        if self._attempt == 0 and item.num_prompt_tokens:
            self._num_prompt_tokens, self._num_cached_tokens = item.num_prompt_tokens, item.num_cached_tokens
        # The engine's failure (a refused schema, named by the engine's field; shutdown): not ours to retry.
        if item.error is not None:
            return self._finish(error=item.error)
        deltas = []
        for d in item.deltas:
            choice = self.choices[self._targets[d.index]]
            part = choice.add(d)
            if d.finish_reason is None:
                if not self.hold:
                    deltas.append(self._pass_on(choice, d, part))
                continue
            out = self._validate(choice, d, part)
            if isinstance(out, StreamError):
                return self._finish(error=out)
            if out is not None:
                deltas.append(out)
        if item.finished and not self._pending:
            return self._finish(deltas=deltas)
        if not deltas:
            return None
        return StreamItem(deltas=deltas, num_prompt_tokens=self._num_prompt_tokens,
                          num_cached_tokens=self._num_cached_tokens)

    def finishes_large(self, item: StreamItem, num_chars: int) -> bool:
        """Whether `item` finishes a completion longer than `num_chars` (its check may take a while)."""
        return any(d.finish_reason is not None and d.index < len(self._targets)
                   and sum(map(len, self.choices[self._targets[d.index]].text)) + len(d.text) > num_chars
                   for d in item.deltas)

    @staticmethod
    def _pass_on(choice: _GuardedChoice, d: Delta, part: ParsedText) -> Delta:
        """A streamed delta as read: content and reasoning now, any calls held until validated."""
        if part.content or part.reasoning or d.logprobs:
            choice.sent = True  # the client has seen part of this completion
        return Delta(choice.index, part.content, d.token_ids, d.logprobs, reasoning=part.reasoning, parsed=True)

    # -- one finished completion -------------------------------------------------------
    def _validate(self, choice: _GuardedChoice, d: Delta, part: ParsedText) -> Delta | StreamError | None:
        """Check a finished completion: the delta to pass on, None (retrying it), or the error."""
        choice.attempts += 1
        parsed = choice.parsed
        try:
            result = self.contract.check(parsed.content, parsed.tool_calls, d.finish_reason, self.policy)
        except Exception as e:  # noqa: BLE001 - jsonschema cannot evaluate the client's schema
            return StreamError(ErrorKind.INVALID_REQUEST, f"the JSON Schema cannot be evaluated by the validator "
                               f"({type(e).__name__}): {e}", param=self.contract.param)
        if isinstance(result, Checked):
            return self._passed(choice, d, part, result)
        why_not = self._why_not_retried(choice)
        if why_not is None:
            self.outcomes.append(("retried", result.reason))
            self._pending.append(choice.index)
            return None
        self.outcomes.append(("rejected", result.reason))
        logger.info("guardrail rejected %s choice %d: %s after %d attempt(s)", self.request.request_id,
                    choice.index, result.reason, choice.attempts)
        detail = result.message if len(self.choices) == 1 else f"choice {choice.index}: {result.message}"
        err = GuardrailError(result.reason, detail, choice.attempts, result.param)
        message = f"{err.message}; {why_not}" if why_not else err.message
        return StreamError(GuardrailError.TYPE, message, param=err.param, code=err.code)

    def _passed(self, choice: _GuardedChoice, d: Delta, part: ParsedText, result: Checked) -> Delta:
        self.outcomes.append(("passed", "redacted" if result.redacted else "none"))
        calls = result.tool_calls or None
        if not self.hold:  # its content and reasoning are out already; redaction is off in this mode
            choice.sent = True
            return Delta(choice.index, part.content, d.token_ids, d.logprobs, d.finish_reason, d.stop_reason,
                         reasoning=part.reasoning, tool_calls=calls, parsed=True)
        # Logprobs of redacted text would tell the client what was redacted: withheld.
        return Delta(choice.index, result.content or "", list(choice.token_ids),
                     None if result.redacted else choice.logprobs, d.finish_reason, d.stop_reason,
                     reasoning=choice.parsed.reasoning, tool_calls=calls, parsed=True)

    def _why_not_retried(self, choice: _GuardedChoice) -> str | None:
        """None if the choice may be generated again; else why not ("" once its attempts are spent)."""
        if choice.sent:
            return "not retried: part of it had already been streamed to the client"
        if self.request.sampling_params.is_greedy:
            return "not retried: greedy decoding (temperature 0) would write the same output again"
        if choice.attempts > self.policy.max_retries:
            return ""  # the message's attempt count says it
        return None

    def _finish(self, deltas: list[Delta] | None = None, error: StreamError | None = None) -> StreamItem:
        self.done = True
        return StreamItem(deltas=deltas or [], num_prompt_tokens=self._num_prompt_tokens,
                          num_cached_tokens=self._num_cached_tokens, finished=True, error=error,
                          guardrail_outcomes=list(self.outcomes))
