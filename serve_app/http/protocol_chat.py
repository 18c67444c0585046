"""Chat messages, function tools and tool_choice, as OpenAI's Chat Completions API defines them.

    messages     system | developer | user | assistant (content, reasoning_content, tool_calls) |
                 tool (content, tool_call_id); text content parts only
    tools        [{"type": "function", "function": {"name", "description", "parameters", "strict"}}];
                 `parameters` must be a valid JSON Schema (Draft 2020-12) of an object
    tool_choice  "none" | "auto" | "required" | {"type": "function", "function": {"name": ...}}

What a forced call's grammar is (`tool_grammar`): a named tool, its parameters schema (the output
is the arguments object); "required", an array of {"name", "parameters"} objects, one per call
(at most one unless parallel_tool_calls), each branch the tool's own schema.
"""
from __future__ import annotations

import json
import re
from typing import Any, Literal

import jsonschema
from pydantic import Field, field_validator, model_validator

from serve_app.http.protocol_base import StrictModel, Unsupported

NO_PARAMETERS = {"type": "object", "properties": {}}  # a tool that takes no arguments
TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")      # OpenAI's rule for function names


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class FunctionCallParam(StrictModel):
    name: str
    arguments: str  # JSON text of an object, as OpenAI sends it back

    @field_validator("arguments")
    @classmethod
    def _check_arguments(cls, v: str) -> str:
        try:
            value = json.loads(v)
        except json.JSONDecodeError as e:
            raise ValueError(f"must be the JSON text of an object: {e}") from None
        if not isinstance(value, dict):
            raise ValueError("must be the JSON text of an object")
        return v


class ToolCallParam(StrictModel):
    """A call in an assistant message of the history."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallParam
    index: int | None = None  # present when a client kept the streamed call's position; meaningless here


_ASSISTANT_ONLY = ("tool_calls", "reasoning_content")


class ChatMessage(StrictModel):
    UNSUPPORTED = {
        "audio": Unsupported("audio output is not supported"),
        "function_call": Unsupported("the deprecated function_call is not supported; use tool_calls"),
        "refusal": Unsupported("refusals are not supported in the history"),
        "annotations": Unsupported("annotations are not supported"),
    }

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None          # assistant
    reasoning_content: str | None = None                   # assistant (vLLM's name, as its replies carry it)
    tool_call_id: str | None = Field(None, validate_default=True)  # tool: required

    @field_validator("content", mode="before")
    @classmethod
    def _check_content(cls, v: Any) -> Any:
        if isinstance(v, list):
            for part in v:
                if not isinstance(part, dict) or part.get("type") != "text":
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise ValueError(f"content part of type {kind!r} is not supported (only 'text')")
        return v

    @field_validator("tool_call_id")
    @classmethod
    def _tool_call_id_for_tools(cls, v: str | None, info) -> str | None:
        role = info.data.get("role")
        if role == "tool" and v is None:
            raise ValueError("a 'tool' message needs the tool_call_id of the call it answers")
        if role != "tool" and v is not None:
            raise ValueError(f"only 'tool' messages carry a tool_call_id, not {role!r} ones")
        return v

    @model_validator(mode="after")
    def _check_role_fields(self):
        if self.content is None and not (self.role == "assistant"):
            raise ValueError(f"content is required for a {self.role!r} message")
        if self.role != "assistant":
            for name in _ASSISTANT_ONLY:
                if getattr(self, name) is not None:
                    raise ValueError(f"{name} belongs to 'assistant' messages, not {self.role!r} ones")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it (developer is system to them)."""
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                                   "content": self.text()}
        if self.role == "assistant" and self.content is None:
            message["content"] = None if self.tool_calls else ""
        for name in ("name", "reasoning_content", "tool_call_id"):
            if getattr(self, name) is not None:
                message[name] = getattr(self, name)
        if self.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": c.function.arguments}} for c in self.tool_calls]
        return message


class FunctionDefinition(StrictModel):
    UNSUPPORTED = {"defer_loading": Unsupported("every tool is in the prompt", (False,))}

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # the arguments are always validated against the whole schema

    @field_validator("name")
    @classmethod
    def _check_name(cls, v: str) -> str:
        if not TOOL_NAME.match(v):
            raise ValueError(f"{v!r} is not a function name: 1 to 64 of a-z, A-Z, 0-9, '_' and '-'")
        return v

    @field_validator("parameters")
    @classmethod
    def _check_parameters(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if not v:  # absent or {}: a function without arguments
            return None
        try:
            jsonschema.Draft202012Validator.check_schema(v)
        except jsonschema.SchemaError as e:
            where = "/".join(str(p) for p in e.path) or "(root)"
            raise ValueError(f"not a valid JSON Schema (Draft 2020-12) at {where}: {e.message}") from None
        if v.get("type") != "object":
            raise ValueError('the arguments of a call are an object: the schema needs "type": "object"')
        return v

    @property
    def schema(self) -> dict[str, Any]:
        return self.parameters or NO_PARAMETERS


class ChatTool(StrictModel):
    UNSUPPORTED = {"defer_loading": Unsupported("every tool is in the prompt", (False,))}

    type: Literal["function"]
    function: FunctionDefinition

    def for_template(self) -> dict[str, Any]:
        return {"type": "function", "function": self.function.model_dump(exclude_none=True)}


class _NamedFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: _NamedFunction


ToolChoiceMode = Literal["none", "auto", "required"]


def parse_tool_choice(v: Any) -> ToolChoiceMode | NamedToolChoice | None:
    """tool_choice's value, or a ValueError saying what it should be."""
    if v is None or v in ("none", "auto", "required"):
        return v
    if isinstance(v, dict) and v.get("type") == "function":
        try:
            return NamedToolChoice.model_validate(v)
        except Exception:  # noqa: BLE001 - pydantic's message for the nested shape is less clear than ours
            pass
    if isinstance(v, dict) and v.get("type") in ("allowed_tools", "custom"):
        raise ValueError(f"tool_choice of type {v['type']!r} is not supported: only function tools")
    raise ValueError('must be "none", "auto", "required" or {"type": "function", "function": {"name": "..."}}')


# -- the grammar of a forced call ------------------------------------------------------------
def required_calls_schema(tools: list[ChatTool], parallel_tool_calls: bool) -> dict[str, Any]:
    """tool_choice "required": a JSON array of {"name", "parameters"} calls, one branch per tool.

    Each tool's schema moves under the root's `$defs` ("tool_<i>"), its local `$ref`s ("#/...")
    rewritten to resolve from there (xgrammar follows pointers through object keys, not array
    indices, so the schemas cannot stay inside `anyOf`). The guardrail validates each call
    against the tool's schema as the client gave it.
    """
    defs, branches = {}, []
    for i, tool in enumerate(tools):
        at = f"#/$defs/tool_{i}"
        defs[f"tool_{i}"] = _rebase_refs(tool.function.schema, at)
        branches.append({"type": "object", "properties": {"name": {"const": tool.function.name},
                                                          "parameters": {"$ref": at}},
                         "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": branches}, "$defs": defs}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    return schema


def _rebase_refs(schema: Any, at: str) -> Any:
    """A copy of `schema` whose local references ("#", "#/...") resolve from `at` instead of the root."""
    if isinstance(schema, list):
        return [_rebase_refs(s, at) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            out[key] = at + value[1:]
        elif key in _SCHEMA_MAPS and isinstance(value, dict):  # name -> schema: a name is never a keyword
            out[key] = {name: _rebase_refs(sub, at) for name, sub in value.items()}
        elif key in _VALUE_KEYWORDS:
            out[key] = value  # values, not schemas: a "$ref" key in them is data
        else:
            out[key] = _rebase_refs(value, at)
    return out


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_VALUE_KEYWORDS = ("enum", "const", "default", "examples")
