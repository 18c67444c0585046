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
    kind, source = _xgrammar_source(params)
    compile_ = {"json": lambda s: compiler.compile_json_schema(s, **_JSON_OPTIONS),
                "ebnf": compiler.compile_grammar, "structural_tag": compiler.compile_structural_tag}[kind]
    return _with_xgrammar_reason(params.form, compile_, source)


def check_form(params: StructuredOutputsParams) -> None:
    """Refuse what compile_form would refuse, without a tokenizer: a batch job checks its response
    format before it starts an engine. The same checks, and xgrammar's grammar (not its token masks)."""
    kind, source = _xgrammar_source(params)
    build = {"json": lambda s: xgr.Grammar.from_json_schema(s, **_JSON_OPTIONS), "ebnf": xgr.Grammar.from_ebnf,
             "structural_tag": xgr.Grammar.from_structural_tag}[kind]
    _with_xgrammar_reason(params.form, build, source)


def clean_xgrammar_error(error: Exception) -> str:
    """xgrammar's reason, without the C++ log prefix."""
    text = _XGRAMMAR_LOG_PREFIX.sub("", str(error).strip())
    return _XGRAMMAR_CHECK_PREFIX.sub("", text)


def _with_xgrammar_reason(form: str, build, source):
    try:
        return build(source)
    except RuntimeError as e:  # xgrammar's own refusals (its structural-tag errors are RuntimeErrors too)
        reason = clean_xgrammar_error(e)
        if form in ("json", "json_object"):  # unsatisfiable bounds, regex features, ...
            raise InvalidRequestError(f"the JSON schema is not supported by grammar-constrained decoding: {reason}",
                                      param="structured_outputs") from None
        raise _refusal(form, reason) from None


def _xgrammar_source(params: StructuredOutputsParams) -> tuple[str, Any]:
    """("json", schema text) | ("ebnf", grammar text) | ("structural_tag", tag), checked first."""
    form = params.form
    if form in ("json", "json_object"):
        schema = _JSON_OBJECT_SCHEMA if params.json_object else params.json
        check_schema(schema)
        return "json", json.dumps(schema)
    if form == "regex":
        try:
            return "ebnf", regex_to_ebnf(params.regex)
        except UnsupportedRegexError as e:
            raise _refusal("regex", str(e)) from None
    if form == "choice":  # an EBNF string literal per choice, every character escaped: no choice is read as syntax
        return "ebnf", "root ::= " + " | ".join(_ebnf_literal(c) for c in params.choice)
    if form == "grammar":
        return "ebnf", params.grammar
    return "structural_tag", _structural_tag(params.structural_tag)


def _structural_tag(tag: dict[str, Any]) -> xgr.StructuralTag | dict[str, Any]:
    if "format" in tag:
        tag = _python_regexes(tag)
    else:  # vLLM's first shape: JSON schemas between begin and end strings, after a trigger
        tag = _from_structures(tag)
    for schema in _json_schemas_in(tag):
        try:
            check_schema(schema)
        except InvalidRequestError as e:
            raise _refusal("structural_tag", f"a JSON schema in it: {e}") from None
    return tag


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
