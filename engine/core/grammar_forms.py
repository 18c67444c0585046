"""Each structured-output form compiled by xgrammar; what it cannot compile is refused by name.

    json, json_object  JSON Schema, checked first (engine/core/json_schema_check.py), then compiled
                       strict, with no free whitespace and the separators ", " and ": "
    regex              Python `re` syntax, written as EBNF with Python's semantics (engine/core/regex_ebnf.py)
    choice             root ::= "first" | "second" | ...  (each choice an escaped literal)
    grammar            EBNF/GBNF as xgrammar takes it, root rule `root`
    structural_tag     vLLM's {"structures": [{"begin", "schema", "end"}], "triggers": [...]}, or
                       xgrammar's {"format": {...}}; the JSON schemas inside are checked as the json
                       form's, and its {"type": "regex"} parts read with Python's semantics too

JSON options: strict mode (objects hold only the properties the schema declares unless
`additionalProperties`/`patternProperties` allow more; OpenAI's "strict" contract), no free
whitespace (a model cannot pad forever with spaces) and the separators trained models write,
(", ", ": "): forcing compact ",", ":" pushes a model off its own distribution, and on
SmolLM2-135M-Instruct it turned "Maria is 34" into "age": 23 on 2 of 5 extraction prompts
at temperature 0 (5 of 5 right with ": "; tests/test_real_model.py).
"""
from __future__ import annotations

import json
import re
from typing import Any

import pydantic
import xgrammar as xgr

from engine.core.json_schema_check import check_schema
from engine.core.regex_ebnf import UnsupportedRegexError, regex_to_ebnf
from engine.errors import InvalidRequestError
from engine.sampling_params import StructuredOutputsParams

_JSON_OPTIONS = {"any_whitespace": False, "separators": (", ", ": "), "strict_mode": True}
_JSON_OBJECT_SCHEMA = {"type": "object"}  # json_object: any JSON document whose top level is an object

# "[13:37:53] /project/x.cc:4944: " and "Check failed: (...) is false: " before xgrammar's reason.
_XGRAMMAR_LOG_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")
_XGRAMMAR_CHECK_PREFIX = re.compile(r"^Check failed: .*? is false:\s*")

# Forms whose documents may hold raw control bytes: a regex, choice or grammar says exactly where
# a newline or tab goes, and a structural tag's free text needs them. JSON never does (its strings
# escape them), so JSON rows also drop the tokens that hold them (see StructuredOutputManager).
CONTROL_BYTES_ALLOWED = frozenset({"regex", "choice", "grammar", "structural_tag"})


def compile_form(compiler: xgr.GrammarCompiler, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
    """The compiled grammar of one constraint; InvalidRequestError names the form and the reason."""
    form = params.form
    try:
        return _COMPILE[form](compiler, params)
    except RuntimeError as e:  # xgrammar's own refusals (its structural-tag errors are RuntimeErrors too)
        raise _refusal(form, clean_xgrammar_error(e)) from None


def clean_xgrammar_error(error: Exception) -> str:
    """xgrammar's reason, without the C++ log prefix."""
    text = _XGRAMMAR_LOG_PREFIX.sub("", str(error).strip())
    return _XGRAMMAR_CHECK_PREFIX.sub("", text)


def _compile_json(compiler: xgr.GrammarCompiler, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
    schema = _JSON_OBJECT_SCHEMA if params.json_object else params.json
    check_schema(schema)
    try:
        return compiler.compile_json_schema(json.dumps(schema), **_JSON_OPTIONS)
    except RuntimeError as e:  # unsatisfiable bounds, regex features, ...
        raise InvalidRequestError("the JSON schema is not supported by grammar-constrained decoding: "
                                  f"{clean_xgrammar_error(e)}", param="structured_outputs") from None


def _compile_regex(compiler: xgr.GrammarCompiler, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
    try:
        return compiler.compile_grammar(regex_to_ebnf(params.regex))
    except UnsupportedRegexError as e:
        raise _refusal("regex", str(e)) from None


def _compile_choice(compiler: xgr.GrammarCompiler, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
    # An EBNF string literal per choice, every character escaped: no choice is read as syntax.
    return compiler.compile_grammar("root ::= " + " | ".join(_ebnf_literal(c) for c in params.choice))


def _compile_grammar(compiler: xgr.GrammarCompiler, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
    return compiler.compile_grammar(params.grammar)


def _compile_structural_tag(compiler: xgr.GrammarCompiler, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
    tag = params.structural_tag
    if "format" in tag:
        tag = _python_regexes(tag)
    else:  # vLLM's first shape: JSON schemas between begin and end strings, after a trigger
        tag = _from_structures(tag)
    for schema in _json_schemas_in(tag):
        try:
            check_schema(schema)
        except InvalidRequestError as e:
            raise _refusal("structural_tag", f"a JSON schema in it: {e}") from None
    return compiler.compile_structural_tag(tag)


def _from_structures(tag: dict[str, Any]) -> xgr.StructuralTag:
    try:
        items = [xgr.StructuralTagItem(begin=s["begin"], schema=s["schema"], end=s["end"]) for s in tag["structures"]]
        return xgr.StructuralTag.from_legacy_structural_tag(items, tag["triggers"])
    except (KeyError, TypeError) as e:
        raise _refusal("structural_tag", f'each structure needs "begin", "schema" and "end" (missing {e})') from None
    except pydantic.ValidationError as e:
        raise _refusal("structural_tag", str(e).splitlines()[0] + ": " + "; ".join(
            f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())) from None


def _python_regexes(node: Any) -> Any:
    """A copy of a structural tag's format in which every {"type": "regex", "pattern": p} is the
    grammar of p under Python's rules (xgrammar's own regex reading differs; see regex_ebnf)."""
    if isinstance(node, list):
        return [_python_regexes(v) for v in node]
    if not isinstance(node, dict) or node.get("type") == "json_schema":
        return node
    if node.get("type") == "regex" and isinstance(node.get("pattern"), str):
        try:
            return {"type": "grammar", "grammar": regex_to_ebnf(node["pattern"])}
        except UnsupportedRegexError as e:
            raise _refusal("structural_tag", f"its regex {node['pattern']!r}: {e}") from None
    return {k: _python_regexes(v) for k, v in node.items()}


def _json_schemas_in(tag: xgr.StructuralTag | dict[str, Any]):
    """Every JSON schema a structural tag holds ({"type": "json_schema", "json_schema": ...} nodes)."""
    stack = [tag.model_dump() if isinstance(tag, xgr.StructuralTag) else tag]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if node.get("type") == "json_schema" and isinstance(node.get("json_schema"), (dict, bool)):
                yield node["json_schema"]
            else:
                stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


def _ebnf_literal(text: str) -> str:
    """text as one EBNF string literal; NUL, which ends xgrammar's literals, as a class of its own."""
    pieces = text.split("\0")
    escaped = ['"' + "".join(f"\\U{ord(ch):08x}" for ch in piece) + '"' for piece in pieces]
    return "(" + ' [\\u0000] '.join(escaped) + ")"


def _refusal(form: str, why: str) -> InvalidRequestError:
    return InvalidRequestError(f"structured_outputs.{form} is invalid: {why}", param=f"structured_outputs.{form}")


_COMPILE = {"json": _compile_json, "json_object": _compile_json, "regex": _compile_regex,
            "choice": _compile_choice, "grammar": _compile_grammar, "structural_tag": _compile_structural_tag}
