"""Which JSON Schema keywords grammar-constrained decoding honours, and the refusal of the rest.

What xgrammar 0.2.8 does with each keyword (found by compiling schemas and reading the grammar):

| class                         | keywords |
|-------------------------------|----------|
| enforced by the grammar       | type (and type lists, i.e. nullable), properties, required, additionalProperties, |
|                               | unevaluatedProperties: false, patternProperties, propertyNames, enum, const, items, |
|                               | prefixItems, minItems, maxItems, minLength, maxLength, pattern, format in           |
|                               | XGRAMMAR_FORMATS, minimum, maximum, exclusiveMinimum/Maximum (integer and number),  |
|                               | multipleOf (integer), minProperties, maxProperties, anyOf, oneOf (as alternatives), |
|                               | allOf with one subschema, local $ref ("#", "#/...") and $defs, recursion included   |
| dropped by the grammar, then  | uniqueItems, not, multipleOf on numbers, oneOf's "exactly one", minLength/maxLength |
| checked by the guardrail      | next to pattern/format, other formats, regex lookaheads, and NARROWING_KEYWORDS     |
| (allowed)                     | next to $ref/anyOf/oneOf/allOf; annotations (title, description, default, ...)      |
| refused (ValueError)          | REFUSED_KEYWORDS; `required` naming an undeclared property that strict mode never   |
|                               | writes; allOf with 2+ subschemas (compiles to "any JSON"); $ref/anyOf/oneOf/allOf   |
|                               | next to keywords that shape the document (xgrammar silently drops them); $ref that  |
|                               | is not a local JSON pointer; whatever xgrammar itself rejects (min > max, empty     |
|                               | enum, regex backreferences, the schema `false`, ...)                                |

The rule: a keyword that only narrows values the grammar already writes may be dropped, since
the guardrail validates the whole schema and retries. A keyword whose loss lets the grammar write
anything, or never write a valid document (a demanded element strict mode forbids), is refused.
"""
from __future__ import annotations

import jsonschema

from engine.errors import InvalidRequestError

XGRAMMAR_FORMATS = frozenset({
    "email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid", "uri",
    "uri-reference", "uri-template", "json-pointer", "relative-json-pointer"})

# Keyword -> why the grammar cannot honour it (it ignores the keyword, and the keyword demands
# content that strict mode never writes, so every output would fail validation).
REFUSED_KEYWORDS = {
    "contains": "the grammar ignores it and never writes the element it demands",
    "minContains": "the grammar ignores it and never writes the elements it demands",
    "maxContains": "the grammar ignores 'contains' and its bounds",
    "if": "conditional subschemas are ignored by the grammar",
    "then": "conditional subschemas are ignored by the grammar",
    "else": "conditional subschemas are ignored by the grammar",
    "dependentRequired": "the grammar ignores it and never writes the properties it demands",
    "dependentSchemas": "the grammar ignores it and never writes the properties it demands",
    "$dynamicRef": "xgrammar compiles it to 'any JSON value'",
    "$dynamicAnchor": "xgrammar compiles it to 'any JSON value'",
}
# Keywords that only carry information for people and tools.
ANNOTATIONS = frozenset({
    "$schema", "$id", "$anchor", "$comment", "$defs", "definitions", "title", "description",
    "default", "examples", "deprecated", "readOnly", "writeOnly", "contentEncoding",
    "contentMediaType", "contentSchema"})
# Keywords that only narrow a value already written: safe for the grammar to drop.
NARROWING_KEYWORDS = frozenset({
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "minLength",
    "maxLength", "pattern", "format", "minItems", "maxItems", "uniqueItems", "minProperties",
    "maxProperties", "not"})
# xgrammar compiles a schema holding one of these from it alone and drops the other keywords.
_REPLACING_KEYWORDS = ("$ref", "anyOf", "oneOf", "allOf")

# Where subschemas sit, so the walk visits schemas and never property names or enum values.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_VALUES = ("items", "additionalProperties", "unevaluatedProperties", "unevaluatedItems",
                  "propertyNames", "contains", "not", "if", "then", "else")
_SCHEMA_LISTS = ("prefixItems", "allOf", "anyOf", "oneOf")


def check_schema(schema: dict | bool) -> None:
    """Raise ValueError if `schema` is not a valid Draft 2020-12 schema or uses a refused part."""
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as e:
        raise InvalidRequestError(f"invalid JSON Schema at {_pointer(e.path)}: {e.message}",
                                  param="structured_outputs") from None
    _check_supported(schema, "#")


def _check_supported(schema, where: str) -> None:
    if not isinstance(schema, dict):
        return  # true/false: nothing to refuse here (xgrammar rejects `false` itself)
    for key, why in REFUSED_KEYWORDS.items():
        if key in schema:
            raise _unsupported(key, where, why)
    ref = schema.get("$ref")
    if ref is not None and not (ref == "#" or ref.startswith("#/")):
        raise _unsupported("$ref", where, f"{ref!r} is not a local reference ('#/...'); xgrammar would allow any value")
    if len(schema.get("allOf", ())) > 1:
        raise _unsupported("allOf", where, "xgrammar compiles 2+ subschemas to 'any JSON value'; merge them")
    for key in _REPLACING_KEYWORDS:
        if key in schema:
            dropped = sorted(set(schema) - ANNOTATIONS - NARROWING_KEYWORDS - {key})
            if dropped:
                raise _unsupported(f"{key}' next to '{dropped[0]}", where,
                                   f"xgrammar compiles '{key}' alone and drops {dropped}; "
                                   "move them into the referenced schema or each branch")
    _check_required_declared(schema, where)
    for child, child_where in _subschemas(schema, where):
        _check_supported(child, child_where)


def _check_required_declared(schema: dict, where: str) -> None:
    # Strict mode writes only declared properties unless extra ones are allowed.
    types = schema.get("type", "object")
    if "object" not in (types if isinstance(types, list) else [types]):
        return  # `required` binds objects only
    extra_allowed = ("patternProperties" in schema
                     or schema.get("additionalProperties", False) is not False
                     or schema.get("unevaluatedProperties", False) is not False)
    declared = schema.get("properties", {})
    missing = [name for name in schema.get("required", ()) if name not in declared]
    if missing and not extra_allowed:
        raise _unsupported("required", where, f"it names {missing[0]!r}, which 'properties' does not "
                           "declare, and strict grammars write only declared properties")


def _subschemas(schema: dict, where: str):
    for key in _SCHEMA_MAPS:
        for name, sub in (schema.get(key) or {}).items():
            yield sub, f"{where}/{key}/{_escape(name)}"
    for key in _SCHEMA_VALUES:
        if key in schema:
            yield schema[key], f"{where}/{key}"
    for key in _SCHEMA_LISTS:
        for i, sub in enumerate(schema.get(key) or ()):
            yield sub, f"{where}/{key}/{i}"


def _unsupported(part: str, where: str, why: str) -> InvalidRequestError:
    return InvalidRequestError(f"'{part}' (at {where}) is not supported by grammar-constrained decoding: {why}",
                               param="structured_outputs")


def _escape(name: str) -> str:  # JSON Pointer (RFC 6901) escaping of one path segment
    return name.replace("~", "~0").replace("/", "~1")


def _pointer(path) -> str:
    return "#" + "".join(f"/{_escape(str(p))}" for p in path)
