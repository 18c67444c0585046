"""Structured output: JSON Schema and "any JSON object" by grammar-constrained decoding (xgrammar).

    compile(params)      worker thread; schema checked, then compiled once per schema (LRU cache)
    new_matcher(grammar) one Matcher per sequence; it lives on the Sequence, so it survives preemption
    fill_bitmask(...)    step loop; int32 [num_seqs, ceil(vocab/32)], applied to the logits first
    accept_token(t)      after each sampled token; is_finished() then says whether the document is done

Grammar options: strict mode (objects hold only the properties the schema declares unless
`additionalProperties`/`patternProperties` allow more; OpenAI's "strict" contract), no free
whitespace (a model cannot pad forever with spaces) and the separators trained models write,
(", ", ": "): forcing compact ",", ":" pushes a model off its own distribution, and on
SmolLM2-135M-Instruct it turned "Maria is 34" into "age": 23 on 2 of 5 extraction prompts
at temperature 0 (5 of 5 right with ": "; tests/test_real_model.py). On top of the grammar, constrained rows never allow tokens with
raw control bytes or special tokens other than the stop tokens (see `_writable_token_ids`).

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

import collections
import json
import os
import re
import threading

import jsonschema
import torch
import xgrammar as xgr

from engine.errors import InvalidRequestError
from engine.math_utils import cdiv
from engine.sampling_params import StructuredOutputsParams

_GRAMMAR_OPTIONS = dict(any_whitespace=False, separators=(", ", ": "), strict_mode=True)
_JSON_OBJECT_SCHEMA = {"type": "object"}  # json_object: any JSON document whose top level is an object

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

_XGRAMMAR_LOG_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")  # "[13:37:53] /project/x.cc:4944: "


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


def _to_int32(word: int) -> int:
    """An unsigned 32-bit word as the signed int32 that torch stores."""
    return word - (1 << 32) if word >= 1 << 31 else word


class Matcher:
    """The grammar state of one sequence. Used by one thread at a time (the step loop)."""

    def __init__(self, compiled: xgr.CompiledGrammar, num_words: int, non_stop_words: torch.Tensor,
                 writable_words: torch.Tensor):
        self._matcher = xgr.GrammarMatcher(compiled)
        self._non_stop_words = non_stop_words  # int32 [num_words]: every token but the stop tokens
        self._writable_words = writable_words  # int32 [num_words]: see _writable_token_ids
        self._mask = torch.empty((1, num_words), dtype=torch.int32)  # next token's allowed set
        self._mask_stale = True  # the mask is filled at most once per accepted token

    def accept_token(self, token_id: int) -> None:
        if not self._matcher.accept_token(token_id):
            raise RuntimeError(f"token {token_id} is not allowed by the grammar (was the bitmask applied?)")
        self._mask_stale = True

    def next_token_mask(self) -> torch.Tensor:
        """int32 [num_words]: bit j of word w set <=> token 32*w + j may come next."""
        if self._mask_stale:
            self._matcher.fill_next_token_bitmask(self._mask, 0)
            self._set_mask(self._mask[0])
        return self._mask[0]

    @property
    def needs_fill(self) -> bool:
        return self._mask_stale and not self._matcher.is_terminated()

    def _set_mask(self, filled: torch.Tensor) -> None:
        """Cache xgrammar's mask for the next token (filled alone or in a batch), writable tokens only."""
        writable = filled & self._writable_words
        # Never empty a row; the guardrail still checks what comes out.
        self._mask[0] = writable if writable.any() else filled
        self._mask_stale = False

    def is_finished(self) -> bool:
        """The sequence must end now: the grammar accepted a stop token (also with ignore_eos,
        where the scheduler would not stop on it), or the document is complete and nothing but
        a stop token may follow. The second case ends the sequence before sampling, so a row
        whose only allowed tokens the sampler then bans (min_tokens bans eos) never occurs."""
        if self._matcher.is_terminated():
            return True
        if not self._matcher.is_completed():  # mid-document: no mask needed to know
            return False
        return not bool((self.next_token_mask() & self._non_stop_words).any())


class StructuredOutputManager:
    """Compiles structured-output requests against one tokenizer and builds the per-step bitmask."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int] | None = None,
                 max_cached_grammars: int = 256):
        # The model's vocab may be padded past the tokenizer's; xgrammar then treats the padding
        # ids as special tokens, which no grammar allows.
        full_vocab = max(vocab_size, len(tokenizer))
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=full_vocab, stop_token_ids=stop_token_ids)
        # Our own LRU below is the one bound on memory, so xgrammar's cache is off.
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=min(8, os.cpu_count() or 1),
                                             cache_enabled=False)
        self.num_words = cdiv(full_vocab, 32)
        self.stop_token_ids = list(self.tokenizer_info.stop_token_ids)
        self._non_stop_words = self._words_with(set(range(full_vocab)) - set(self.stop_token_ids))
        self._writable_words = self._words_with(self._writable_token_ids(tokenizer))
        self._cache: collections.OrderedDict[str, xgr.CompiledGrammar] = collections.OrderedDict()
        self._max_cached = max_cached_grammars
        self._lock = threading.Lock()  # compile() runs on worker threads
        self._batch_matcher = xgr.BatchGrammarMatcher(max_threads=min(8, os.cpu_count() or 1))

    def _writable_token_ids(self, tokenizer) -> set[int]:
        """Tokens a JSON document may contain, on top of what the grammar says:
        - none with a raw control byte (U+0000-U+001F): JSON forbids them inside strings and
          our grammars have no free whitespace, yet xgrammar 0.2.8 lets them into strings with
          minLength/maxLength (mlc-ai/xgrammar#800);
        - no special token but the stop tokens: the detokenizer drops them, so the text would
          not be what the grammar accepted."""
        special = set(getattr(tokenizer, "all_special_ids", ())) - set(self.stop_token_ids)
        return {t for t, piece in enumerate(self.tokenizer_info.decoded_vocab)
                if t not in special and not any(b < 0x20 for b in piece)} | set(self.stop_token_ids)

    def _words_with(self, token_ids) -> torch.Tensor:
        """int32 [num_words] with exactly the bits of `token_ids` set."""
        words = [0] * self.num_words
        for t in token_ids:
            words[t // 32] |= 1 << (t % 32)
        return torch.tensor([_to_int32(w) for w in words], dtype=torch.int32)

    def compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """The compiled grammar of a request; ValueError names what is invalid or unsupported."""
        key = params.key()
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                return compiled
        # Compiled outside the lock so that one large schema does not hold up the others; two
        # threads compiling the same new schema at once both finish, and the first one is kept.
        compiled = self._compile_uncached(params)
        with self._lock:
            compiled = self._cache.setdefault(key, compiled)
            self._cache.move_to_end(key)
            while len(self._cache) > self._max_cached:
                self._cache.popitem(last=False)
        return compiled

    def _compile_uncached(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        schema = _JSON_OBJECT_SCHEMA if params.json_object else params.json
        check_schema(schema)
        try:
            return self._compiler.compile_json_schema(json.dumps(schema), **_GRAMMAR_OPTIONS)
        except RuntimeError as e:  # xgrammar's own refusals (unsatisfiable bounds, regex features)
            reason = _XGRAMMAR_LOG_PREFIX.sub("", str(e).strip())
            raise InvalidRequestError(f"the JSON schema is not supported by grammar-constrained decoding: {reason}",
                                      param="structured_outputs") from None

    def new_matcher(self, compiled: xgr.CompiledGrammar) -> Matcher:
        return Matcher(compiled, self.num_words, self._non_stop_words, self._writable_words)

    def fill_bitmask(self, matchers: list[Matcher | None]) -> torch.Tensor:
        """int32 [len(matchers), num_words] on CPU, xgrammar's layout (bit j of word w = token
        32*w + j). Rows without a live grammar are all ones (-1): every token allowed."""
        bitmask = torch.full((len(matchers), self.num_words), -1, dtype=torch.int32)
        stale = [i for i, m in enumerate(matchers) if m is not None and m.needs_fill]
        if len(stale) > 1:  # one call, xgrammar's threads over the rows, instead of a Python loop
            self._batch_matcher.batch_fill_next_token_bitmask([matchers[i]._matcher for i in stale],
                                                              bitmask, stale)
            for i in stale:
                matchers[i]._set_mask(bitmask[i])
        for i, matcher in enumerate(matchers):
            if matcher is not None:
                bitmask[i] = -1 if matcher.is_finished() else matcher.next_token_mask()
        return bitmask
