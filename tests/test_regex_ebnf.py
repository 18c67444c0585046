"""engine/core/regex_ebnf.py: the grammar of a pattern accepts exactly what re.fullmatch accepts.

Each pattern's grammar is compiled by xgrammar against a vocabulary of single characters, and
every string of up to 4 of them (a random sample) is accepted by the grammar if and only if
Python's re.fullmatch accepts it. The characters are the ones where xgrammar's own regex reading
and Python's differ: newline for ".", Unicode digits and spaces for \\d \\D \\s \\S, \\w
letters outside ASCII, NUL, quotes and backslashes that need escaping in EBNF.
"""
import random
import re

import pytest
import xgrammar as xgr

from engine.core.regex_ebnf import UnsupportedRegexError, regex_to_ebnf

ALPHABET = ["a", "b", "c", "0", "9", "\n", "\t", " ", "\u2003", "\u0663", "\u00e9", "_", "-", '"', "\\", "]",
            "^", "\x00", "A", "Z", "\U0001f600"]


@pytest.fixture(scope="module")
def compiler():
    return xgr.GrammarCompiler(xgr.TokenizerInfo(ALPHABET))


def _samples(n: int = 1500) -> list[str]:
    rng = random.Random(0)
    return [""] + ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 4))) for _ in range(n)]


def _accepts(compiled, text: str) -> bool:
    matcher = xgr.GrammarMatcher(compiled)
    return matcher.accept_string(text) and matcher.is_completed() if text else matcher.is_completed()


@pytest.mark.parametrize("pattern", [
    r"a.b", r"(?s)a.b", r"\Aab\Z", r"^a|b$", r"\d+", r"\D\D", r"\s\S?", r"\W+", r"\w+", r"(?a)\w+", r"(?a)\S",
    r"[^\s]", r"[^a-c\d]+", r"a\0b", r"(ab|a)*?b", r"[\"\\\]\-^]+", r'"\\', r"a{2,3}", r"(a|b){0,3}c?",
    r"(?x) a  b # a comment", r"(?m)^a$", "\U0001f600+", r"[a-c][^\n]{0,2}", r"(?:a|)", r"x*|\x00",
])
def test_grammar_accepts_exactly_what_fullmatch_accepts(compiler, pattern):
    compiled = compiler.compile_grammar(regex_to_ebnf(pattern))
    wrong = [s for s in _samples() if _accepts(compiled, s) != bool(re.fullmatch(pattern, s))]
    assert not wrong, f"{pattern!r}: {wrong[:5]!r}"


@pytest.mark.parametrize("pattern, named", [
    (r"(?=a)a", "lookaround"), (r"a(?!b)", "lookaround"), (r"(?<=a)b", "lookaround"),
    (r"(a)\1", "backreferences"), (r"(?P<x>a)(?P=x)", "backreferences"), (r"(a)?(?(1)b|c)", "conditional"),
    (r"\bword", "word boundaries"), (r"a\B", "word boundaries"), (r"a*+", "possessive"), (r"(?>ab)", "atomic"),
    (r"(?i)abc", "case-insensitive"), (r"(?s:a.)b", "flags scoped to a group"), (r"a$b", "anchors"),
    (r"a^", "anchors"), (r"(a$)*", "anchors"), (r"[^\s\S]", "matches no character"), ("\ud800", "surrogate"),
    (r"(", "not a valid regular expression"), (r"a{,3", None), ("(" * 2000 + ")" * 2000, "nests too deeply"),
])
def test_what_no_grammar_expresses_is_refused_by_name(pattern, named):
    if named is None:  # Python reads "a{,3" as literal text: a valid pattern, translated as such
        assert regex_to_ebnf(pattern) == 'root ::= "a{,3"'
        return
    with pytest.raises(UnsupportedRegexError, match=re.escape(named)):
        regex_to_ebnf(pattern)


def test_anchors_at_the_ends_are_dropped_only_there():
    assert regex_to_ebnf(r"^ab$") == regex_to_ebnf(r"\Aab\Z") == regex_to_ebnf(r"ab") == 'root ::= "ab"'
    assert regex_to_ebnf(r"^(a|^b)$") == 'root ::= (("a" | "b"))'  # each branch starts the match
