"""A Python `re` pattern as an xgrammar EBNF grammar of exactly the strings `re.fullmatch` accepts.

xgrammar's own regex front end reads a pattern with other rules than Python's, and where they
differ it changes the pattern silently (xgrammar 0.2.8, found by compiling patterns):

    .          any character, newline included (Python: anything but "\\n")
    \\A \\Z      the letters "A" and "Z" (a warning on stderr)
    a$b        the "$" is dropped (Python: never matches)
    \\0         the empty string (Python: NUL)
    \\S \\D \\W   ASCII complements, so "\\u2003" or "٣" may be written (Python excludes them)

So the pattern is parsed by Python's own parser (`re._parser`, the one `re.compile` uses) and
its tree written as EBNF here: the character sets are Python's (`\\d`, `\\w`, `\\s` computed
by Python's `re` itself over every code point), and what cannot be written as a grammar is
refused by name instead of approximated:

    refused                              why
    (?=...) (?!...) (?<=...) (?<!...)    lookaround: no context-free equivalent here
    \\1 (?P=name) (?(1)a|b)               backreferences and conditionals: not context-free
    \\b \\B                                word boundaries: zero-width context
    a*+ (?>...)                          possessive / atomic: a smaller language than the greedy one
    (?i) and (?flags:...)                case folding, and flags scoped to a group
    ^ \\A $ \\Z not at the pattern's ends   an anchor in the middle constrains the neighbours
    surrogates, an empty class           nothing a model can write

Lazy repetition (`*?`) accepts the same strings as greedy under fullmatch, so it is kept;
global `(?s)`, `(?x)`, `(?a)` and `(?m)` are honoured.
"""
from __future__ import annotations

import functools
import re

# Python's own regex parser and its opcodes (private modules of CPython >= 3.11, which re.compile uses).
from re import _constants as C
from re import _parser


class UnsupportedRegexError(ValueError):
    """The pattern is not a Python regex, or uses a part no grammar here can express; says which."""


_MAX_CODE_POINT = 0x10FFFF
_SURROGATES = (0xD800, 0xDFFF)
_SUPPORTED_FLAGS = C.SRE_FLAG_UNICODE | C.SRE_FLAG_ASCII | C.SRE_FLAG_DOTALL | C.SRE_FLAG_VERBOSE | C.SRE_FLAG_MULTILINE
_BEGIN_ANCHORS = (C.AT_BEGINNING, C.AT_BEGINNING_STRING)
_END_ANCHORS = (C.AT_END, C.AT_END_STRING)
_CATEGORY_PATTERNS = {C.CATEGORY_DIGIT: r"\d", C.CATEGORY_NOT_DIGIT: r"\D", C.CATEGORY_SPACE: r"\s",
                      C.CATEGORY_NOT_SPACE: r"\S", C.CATEGORY_WORD: r"\w", C.CATEGORY_NOT_WORD: r"\W"}
_REFUSED = {
    C.ASSERT: "lookaround assertions ((?=...), (?<=...)) are not supported",
    C.ASSERT_NOT: "lookaround assertions ((?!...), (?<!...)) are not supported",
    C.GROUPREF: "backreferences (\\1, (?P=name)) are not supported",
    C.GROUPREF_EXISTS: "conditional groups ((?(1)...|...)) are not supported",
    C.ATOMIC_GROUP: "atomic groups ((?>...)) are not supported",
    C.POSSESSIVE_REPEAT: "possessive repeats (*+, ++, ?+, {m,n}+) are not supported",
}

Ranges = list[tuple[int, int]]  # sorted, disjoint, inclusive code point ranges


def regex_to_ebnf(pattern: str) -> str:
    """EBNF (root rule `root`) accepting exactly the strings `re.fullmatch(pattern, s)` accepts."""
    try:
        parsed = _parser.parse(pattern)
    except (re.error, OverflowError) as e:
        raise UnsupportedRegexError(f"not a valid regular expression: {e}") from None
    except RecursionError:
        raise UnsupportedRegexError("the pattern nests too deeply") from None
    flags = parsed.state.flags
    if flags & ~_SUPPORTED_FLAGS:
        raise UnsupportedRegexError("case-insensitive matching ((?i)) is not supported; spell out the cases, e.g. [Aa]")
    try:
        return "root ::= " + _Writer(flags).sequence(list(parsed), at_start=True, at_end=True)
    except RecursionError:
        raise UnsupportedRegexError("the pattern nests too deeply") from None


class _Writer:
    def __init__(self, flags: int):
        self.dotall = bool(flags & C.SRE_FLAG_DOTALL)
        self.ascii = bool(flags & C.SRE_FLAG_ASCII)

    def sequence(self, items: list, at_start: bool, at_end: bool) -> str:
        """Items in a row; at_start / at_end: nothing can come before / after them in the match."""
        # Items up to `lead` have only begin anchors before them, items from `trail` only end anchors after.
        lead = next((i for i, (op, av) in enumerate(items) if not (op is C.AT and av in _BEGIN_ANCHORS)), len(items))
        trail = next((i for i in reversed(range(len(items)))
                      if not (items[i][0] is C.AT and items[i][1] in _END_ANCHORS)), -1)
        parts = []
        for i, (op, av) in enumerate(items):
            part = self.item(op, av, at_start and i <= lead, at_end and i >= trail)
            if part:
                parts.append(part)
        return " ".join(_merge_literals(parts)) if parts else '""'

    def item(self, op, av, at_start: bool, at_end: bool) -> str:
        if op in _REFUSED:
            raise UnsupportedRegexError(_REFUSED[op])
        if op is C.LITERAL:
            return _literal(av)
        if op is C.NOT_LITERAL:
            return _char_class(_complement([(av, av)]))
        if op is C.ANY:
            return _char_class([(0, _MAX_CODE_POINT)] if self.dotall else _complement([(10, 10)]))
        if op is C.IN:
            return _char_class(self.class_ranges(av))
        if op is C.BRANCH:
            return "(" + " | ".join(self.sequence(list(alt), at_start, at_end) for alt in av[1]) + ")"
        if op is C.SUBPATTERN:
            _group, add_flags, del_flags, sub = av
            if add_flags or del_flags:
                raise UnsupportedRegexError("flags scoped to a group ((?s:...), (?i:...)) are not supported; "
                              "set them for the whole pattern at its start, e.g. (?s)")
            return "(" + self.sequence(list(sub), at_start, at_end) + ")"
        if op in (C.MAX_REPEAT, C.MIN_REPEAT):  # lazy or greedy: the same strings under fullmatch
            low, high, sub = av
            return "(" + self.sequence(list(sub), False, False) + ")" + _repeat(low, high)
        if op is C.AT:
            return _anchor(av, at_start, at_end)
        raise UnsupportedRegexError(f"the construct {op} is not supported")

    def class_ranges(self, items: list) -> Ranges:
        negate = bool(items) and items[0][0] is C.NEGATE
        ranges: Ranges = []
        for op, av in items[1:] if negate else items:
            if op is C.LITERAL:
                ranges.append((av, av))
            elif op is C.RANGE:
                ranges.append(av)
            elif op is C.CATEGORY:
                ranges.extend(_category_ranges(av, self.ascii))
            else:
                raise UnsupportedRegexError(f"the character class item {op} is not supported")
        ranges = _normalize(ranges)
        return _complement(ranges) if negate else ranges


def _anchor(at, at_start: bool, at_end: bool) -> str:
    if at in _BEGIN_ANCHORS and at_start or at in _END_ANCHORS and at_end:
        return ""  # re.fullmatch anchors both ends already
    if at in (C.AT_BOUNDARY, C.AT_NON_BOUNDARY):
        raise UnsupportedRegexError("word boundaries (\\b, \\B) are not supported")
    raise UnsupportedRegexError("anchors (^, $, \\A, \\Z) are supported only at the start and end of the pattern")


def _repeat(low: int, high: int) -> str:
    if high is C.MAXREPEAT:
        return {0: "*", 1: "+"}.get(low, f"{{{low},}}")
    if (low, high) == (0, 1):
        return "?"
    return f"{{{low}}}" if low == high else f"{{{low},{high}}}"


def _literal(code_point: int) -> str:
    if _SURROGATES[0] <= code_point <= _SURROGATES[1]:
        raise UnsupportedRegexError(f"the surrogate \\u{code_point:04x} can never be written")
    if code_point == 0:
        return "[\\u0000]"  # xgrammar ends a string literal at NUL
    return '"' + _escape(code_point) + '"'


def _merge_literals(parts: list[str]) -> list[str]:
    """'"a" "b"' -> '"ab"': shorter grammars, same language."""
    out: list[str] = []
    for part in parts:
        if out and _is_string(part) and _is_string(out[-1]):
            out[-1] = out[-1][:-1] + part[1:]
        else:
            out.append(part)
    return out


def _is_string(part: str) -> bool:
    return len(part) >= 2 and part[0] == '"' and part[-1] == '"'


def _escape(code_point: int) -> str:
    if 0x20 < code_point < 0x7F and chr(code_point) not in '"\\[]-^':
        return chr(code_point)
    return f"\\u{code_point:04x}" if code_point <= 0xFFFF else f"\\U{code_point:08x}"


def _char_class(ranges: Ranges) -> str:
    """The shorter of [ranges] and [^complement]; surrogates are never in either."""
    if not ranges:
        raise UnsupportedRegexError("a character class matches no character")
    complement = _complement(ranges)
    if len(complement) < len(ranges):  # e.g. [^\n] rather than its 3 positive ranges
        return "[^" + _class_items(complement + [_SURROGATES]) + "]"
    return "[" + _class_items(ranges) + "]"


def _class_items(ranges: Ranges) -> str:
    return "".join(_escape(lo) if lo == hi else f"{_escape(lo)}-{_escape(hi)}" for lo, hi in ranges)


def _normalize(ranges: Ranges) -> Ranges:
    """Sorted and merged, surrogates cut out."""
    out: Ranges = []
    for lo, hi in sorted(ranges):
        for a, b in _without_surrogates(lo, hi):
            if out and a <= out[-1][1] + 1:
                out[-1] = (out[-1][0], max(out[-1][1], b))
            else:
                out.append((a, b))
    return out


def _without_surrogates(lo: int, hi: int) -> Ranges:
    s_lo, s_hi = _SURROGATES
    pieces = [(lo, min(hi, s_lo - 1)), (max(lo, s_hi + 1), hi)]
    return [(a, b) for a, b in pieces if a <= b]


def _complement(ranges: Ranges) -> Ranges:
    """Every code point (surrogates aside) that `ranges` (normalized) leaves out."""
    out: Ranges = []
    start = 0
    for lo, hi in ranges:
        if lo > start:
            out.append((start, lo - 1))
        start = hi + 1
    if start <= _MAX_CODE_POINT:
        out.append((start, _MAX_CODE_POINT))
    return _normalize(out)


@functools.cache
def _category_ranges(category, ascii_only: bool) -> tuple[tuple[int, int], ...]:
    """The code points Python's own `re` puts in \\d, \\w, \\s or their complements (with (?a) or not)."""
    pattern = re.compile(_CATEGORY_PATTERNS[category] + "+", re.ASCII if ascii_only else 0)
    return tuple((m.start(), m.end() - 1) for m in pattern.finditer(_every_code_point()))


@functools.cache
def _every_code_point() -> str:
    # Index i holds chr(i); surrogates are replaced by NUL so that the positions stay code points
    # (the ranges found over them are cut out again by _normalize).
    return "".join(chr(i) if not _SURROGATES[0] <= i <= _SURROGATES[1] else "\0" for i in range(_MAX_CODE_POINT + 1))
