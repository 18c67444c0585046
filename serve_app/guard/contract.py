"""What a completion's answer must satisfy, by what the request asked for: pure checks, no Ray.

    JsonContract          response_format / structured_outputs / guided_json: the answer is one
                          JSON document of the schema (policy.check_output)
    NamedToolContract     tool_choice {"function": {"name": N}}: the answer is N's arguments object
    RequiredToolsContract tool_choice "required": the answer is [{"name", "parameters"}, ...]
    AutoToolsContract     tool_choice "auto": the calls the tool-call parser found in the answer

Every call is checked as a JSON document of its tool's `parameters` schema, whole (keywords the
grammar drops included) and under the server's policy (size, depth, redaction), and must name a
tool of the request. A passed completion comes back as its content and its calls (ids made here
for forced calls; redacted arguments re-serialized); a failed one as the violation, whose reason
is one of policy.REASONS. The reasoning is never checked: it is not the answer.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from engine.entrypoints.tool_parsers import make_tool_call_id
from serve_app.guard.policy import GuardrailPolicy, GuardrailResult, check_output
from serve_app.http.messages import OutputSpec, ToolCall, ToolsSpec

TOOLS_PARAM = "tools"  # what a violation by a tool call names


@dataclass
class Checked:
    """A completion's answer that passed: what the client gets."""

    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)
    redacted: bool = False  # the policy's redact_patterns changed it


@dataclass
class Violation:
    reason: str   # one of policy.REASONS
    message: str
    param: str    # the request field whose contract was violated


class JsonContract:
    def __init__(self, schema: dict | bool | None, json_object: bool, param: str):
        self.schema, self.json_object, self.param = schema, json_object, param

    def check(self, content: str, calls: list[ToolCall], finish_reason: str | None,
              policy: GuardrailPolicy) -> Checked | Violation:
        result = check_output(content, self.schema, self.json_object, policy, finish_reason)
        if not result.passed:
            return Violation(result.reason, result.message, self.param)
        return Checked(result.text, redacted=result.text != content)


class NamedToolContract:
    param = TOOLS_PARAM

    def __init__(self, tools: ToolsSpec):
        self.name, self.schema = tools.named, tools.schemas[tools.named]

    def check(self, content, calls, finish_reason, policy) -> Checked | Violation:
        result = check_output(content, self.schema, True, policy, finish_reason)
        if not result.passed:
            return _call_violation(0, self.name, result)
        return Checked(None, [ToolCall(make_tool_call_id(), self.name, result.text)], result.text != content)


class RequiredToolsContract:
    param = TOOLS_PARAM

    def __init__(self, tools: ToolsSpec):
        self.schemas, self.parallel = tools.schemas, tools.parallel_tool_calls

    def check(self, content, calls, finish_reason, policy) -> Checked | Violation:
        result = check_output(content, _CALL_LIST, False, policy, finish_reason)
        if not result.passed:
            return Violation(result.reason, result.message, TOOLS_PARAM)
        found = [ToolCall(make_tool_call_id(), c["name"], json.dumps(c["parameters"], ensure_ascii=False))
                 for c in result.document]
        return _check_calls(found, self.schemas, self.parallel, policy)


class AutoToolsContract:
    param = TOOLS_PARAM

    def __init__(self, tools: ToolsSpec, content_contract: JsonContract | None):
        self.schemas, self.parallel = tools.schemas, tools.parallel_tool_calls
        self.content_contract = content_contract  # a JSON form as well: for an answer without calls

    def check(self, content, calls, finish_reason, policy) -> Checked | Violation:
        if not calls:
            if self.content_contract is not None:
                return self.content_contract.check(content, calls, finish_reason, policy)
            return Checked(content or None)
        checked = _check_calls(calls, self.schemas, self.parallel, policy)
        if isinstance(checked, Checked):
            checked.content = content or None
        return checked


# The shape a "required" answer has (its grammar's, without the tools' schemas: each call's
# arguments are then checked against its own tool's, for a message that names the call).
_CALL_LIST = {"type": "array", "minItems": 1, "items": {
    "type": "object", "properties": {"name": {"type": "string"}, "parameters": {"type": "object"}},
    "required": ["name", "parameters"], "additionalProperties": False}}


def _check_calls(calls: list[ToolCall], schemas: dict, parallel: bool,
                 policy: GuardrailPolicy) -> Checked | Violation:
    if not parallel and len(calls) > 1:
        return Violation("parallel_tool_calls", f"{len(calls)} tool calls, and parallel_tool_calls is false",
                         TOOLS_PARAM)
    checked, redacted = [], False
    for i, call in enumerate(calls):
        if call.name not in schemas:
            return Violation("unknown_tool", f"tool call {i} names {call.name!r}, which is not one of the tools "
                             f"({', '.join(schemas)})", TOOLS_PARAM)
        result = check_output(call.arguments, schemas[call.name], True, policy)
        if not result.passed:
            return _call_violation(i, call.name, result)
        redacted = redacted or result.text != call.arguments
        checked.append(ToolCall(call.id, call.name, result.text))
    return Checked(None, checked, redacted)


def _call_violation(index: int, name: str, result: GuardrailResult) -> Violation:
    if result.reason == "not_an_object":
        message = "the arguments are not a JSON object"
    else:  # check_output words it about "the output"
        message = result.message
        for said, meant in _ABOUT_ARGUMENTS:
            message = message.replace(said, meant, 1)
    return Violation(result.reason, f"tool call {index} ({name}): {message}", TOOLS_PARAM)


_ABOUT_ARGUMENTS = (("the output does", "the arguments do"), ("the output is", "the arguments are"),
                    ("the output nests", "the arguments nest"))


def make_contract(spec: OutputSpec | None, structured) -> JsonContract | NamedToolContract | \
        RequiredToolsContract | AutoToolsContract | None:
    """The contract of a request from its OutputSpec and its StructuredOutputsParams (None: nothing to check)."""
    param = spec.param if spec is not None else "response_format"
    content = None
    if structured is not None and structured.form in ("json", "json_object"):
        content = JsonContract(None if structured.json_object else structured.json, structured.json_object, param)
    tools = spec.tools if spec is not None else None
    if tools is None:
        return content
    if tools.choice == "named":
        return NamedToolContract(tools)
    if tools.choice == "required":
        return RequiredToolsContract(tools)
    return AutoToolsContract(tools, content)
