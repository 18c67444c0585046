"""Every structured-output form beyond JSON, end to end: regex, choice, EBNF grammar, structural tag.

The tiny model has random weights, so only the grammar makes its outputs match: every output
below that matches does so because of the bitmask. The patterns are bounded, so each output
ends within max_tokens ("stop", from `Matcher.is_finished` even with ignore_eos).
"""
import ast
import asyncio
import json
import re

import pytest
import torch

from engine import (
    LLM,
    AsyncLLM,
    EngineConfig,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)
from engine.core.grammar_forms import check_form
from engine.errors import InvalidRequestError

EMAIL = r"[a-z]{1,6}@[a-z]{1,5}\.(com|org)"
HEADER = r"[A-Z][a-z]{0,5}:\n.{1,6}"  # "." is Python's: anything but a second newline
CHOICES = ["yes", "no", "maybe so", "two\nlines", "\u00fcn\u00efc\u00f8d\u00e9"]
# Arithmetic nested at most twice, at most three terms per level: always short.
ARITHMETIC = r"""
root  ::= expr
expr  ::= term (op term){0,2}
term  ::= num | "(" inner ")"
inner ::= num (op num){0,2}
num   ::= [1-9] [0-9]{0,2}
op    ::= " + " | " - " | " * "
"""
TAG = {"type": "structural_tag", "format": {
    "type": "tag", "begin": "<n>", "content": {"type": "regex", "pattern": r"\d{1,3}"}, "end": "</n>"}}
SEEDS = range(3)


def _forms() -> dict[str, StructuredOutputsParams]:
    return {"email": StructuredOutputsParams(regex=EMAIL), "header": StructuredOutputsParams(regex=HEADER),
            "choice": StructuredOutputsParams(choice=CHOICES), "grammar": StructuredOutputsParams(grammar=ARITHMETIC),
            "tag": StructuredOutputsParams(structural_tag=TAG)}


def _matches(name: str, text: str) -> bool:
    if name in ("email", "header"):
        return re.fullmatch(EMAIL if name == "email" else HEADER, text) is not None
    if name == "choice":
        return text in CHOICES
    if name == "tag":
        return re.fullmatch(r"<n>[0-9]{1,3}</n>", text) is not None
    return _is_arithmetic(text)


def _is_arithmetic(text: str) -> bool:
    """Python's own parser: an expression of integer literals and + - * only."""
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        return False
    allowed = (ast.Expression, ast.BinOp, ast.Constant, ast.Add, ast.Sub, ast.Mult)
    return all(isinstance(node, allowed) for node in ast.walk(tree))


@pytest.fixture(scope="module")
def engines(tiny_llama) -> dict[bool, LLM]:
    """async_scheduling -> engine. 14 KV blocks (224 tokens) for a batch that wants far more: preemption is certain."""
    return {overlap: LLM(tiny_llama, dtype="float32", device="cpu", num_kv_blocks=14, max_num_batched_tokens=256,
                         async_scheduling=overlap) for overlap in (False, True)}


@pytest.fixture(scope="module")
def runs(engines):
    """Every form x every seed, n=2, at temperature 1, in one batch, on both engines: async_scheduling
    -> (form names, outputs, preemptions). Prompts of 40 tokens keep the cache short; the two
    completions of a request share their prompt's blocks (prefix caching); the ignore_eos twin of
    each request must still end with its document."""
    names, prompts, params = [], [], []
    for k, (name, form) in enumerate(_forms().items()):
        for seed, ignore_eos in [(seed, False) for seed in SEEDS] + [(0, True)]:
            names.append(name)
            prompts.append({"prompt_token_ids": [(7 * k + 3 * seed + i) % 900 + 3 for i in range(40)]})
            params.append(SamplingParams(temperature=1.0, seed=seed, n=2, max_tokens=48, ignore_eos=ignore_eos,
                                         structured_outputs=form))
    out = {}
    for overlap, llm in engines.items():
        preempted = llm.llm_engine.scheduler.num_preemptions
        outs = llm.generate(prompts, params, use_tqdm=False)
        out[overlap] = names, outs, llm.llm_engine.scheduler.num_preemptions - preempted
    return out


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlapped"])
def test_every_output_matches_its_form(runs, overlap):
    names, outs, _ = runs[overlap]
    for name, out in zip(names, outs):
        for c in out.outputs:
            assert c.finish_reason == "stop" and _matches(name, c.text), (name, c.text, c.finish_reason)
    for name in _forms():  # temperature 1 did sample different documents
        assert len({c.text for n, out in zip(names, outs) if n == name for c in out.outputs}) > 1, name


def test_preemption_happened_and_nothing_leaked(engines, runs):
    for overlap, llm in engines.items():
        assert runs[overlap][2] > 0, "the small cache should have forced preemption"
        llm.llm_engine.block_manager.check_no_leak()


def test_outputs_do_not_depend_on_overlapped_scheduling(runs):
    """Seeded rows sample from their own generators: the overlapped engine writes the same documents."""
    texts = {overlap: [c.text for out in outs for c in out.outputs] for overlap, (_, outs, _) in runs.items()}
    assert texts[True] == texts[False]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_every_form_on_cuda(tiny_llama):
    """bf16 logits, CUDA graphs and overlapped scheduling (on by default on CUDA): the same contract."""
    llm = LLM(tiny_llama, device="cuda", gpu_memory_utilization=0.3)
    assert llm.llm_engine.async_scheduling
    names = [name for name in _forms() for _ in SEEDS]
    params = [SamplingParams(temperature=1.0, seed=seed, n=2, max_tokens=48, structured_outputs=form)
              for form in _forms().values() for seed in SEEDS]
    for name, out in zip(names, llm.generate(["Write:"] * len(params), params, use_tqdm=False)):
        for c in out.outputs:
            assert c.finish_reason == "stop" and _matches(name, c.text), (name, c.text)
    llm.llm_engine.block_manager.check_no_leak()


def test_streamed_regex_output_matches(tiny_llama):
    async def run(llm):
        params = SamplingParams(temperature=1.0, seed=5, max_tokens=48, output_kind=RequestOutputKind.DELTA,
                                structured_outputs=StructuredOutputsParams(regex=HEADER))
        deltas = [out async for out in llm.generate("Header please", params, "r")]
        return "".join(d.outputs[0].text for d in deltas), len(deltas), deltas[-1].outputs[0].finish_reason

    with AsyncLLM(EngineConfig(model=tiny_llama, device="cpu", dtype="float32")) as llm:
        text, num_deltas, finish_reason = asyncio.run(run(llm))
    assert num_deltas > 1 and finish_reason == "stop" and re.fullmatch(HEADER, text), text


# -- what each form lets the model write -----------------------------------------
def _allowed(row) -> set[int]:
    return {32 * w + j for w, word in enumerate(row.tolist()) for j in range(32) if (word >> j) & 1}


@pytest.fixture(scope="module")
def manager(engines):
    return engines[False].llm_engine.structured_outputs


def _newline_tokens(manager) -> set[int]:
    pieces = manager.tokenizer_info.decoded_vocab
    return {t for t, piece in enumerate(pieces) if b"\n" in piece}


@pytest.mark.parametrize("form", [StructuredOutputsParams(regex="a(\nb|bb)"),
                                  StructuredOutputsParams(choice=["a\nb", "abb"]),
                                  StructuredOutputsParams(grammar='root ::= "a" ("\\nb" | "bb")')])
def test_regex_choice_and_grammar_may_write_newlines(manager, form):
    """JSON rows drop tokens with raw control bytes; these forms say where a newline goes, so a
    newline stays allowed beside the other branch (filtering it would silently narrow the form)."""
    matcher = manager.new_matcher(manager.compile(form))
    matcher.accept_token(manager.tokenizer_info.decoded_vocab.index(b"a"))
    allowed = _allowed(manager.fill_bitmask([matcher])[0])
    assert allowed & _newline_tokens(manager) and any(manager.tokenizer_info.decoded_vocab[t].startswith(b"b")
                                                      for t in allowed)


def test_json_rows_still_never_write_control_bytes(manager):
    matcher = manager.new_matcher(manager.compile(StructuredOutputsParams(json={"type": "string", "maxLength": 5})))
    matcher.accept_token(manager.tokenizer_info.decoded_vocab.index(b'"'))
    assert not _allowed(manager.fill_bitmask([matcher])[0]) & _newline_tokens(manager)


def test_vllm_structures_constrain_text_after_the_trigger(manager):
    """vLLM's structural tag: free text until a trigger, then begin + the schema's JSON + end."""
    tag = {"type": "structural_tag", "triggers": ["<f="],
           "structures": [{"begin": "<f=add>", "schema": {"type": "integer", "minimum": 0, "maximum": 9},
                           "end": "</f>"}]}
    matcher = manager.new_matcher(manager.compile(StructuredOutputsParams(structural_tag=tag)))
    pieces = manager.tokenizer_info.decoded_vocab
    free = _allowed(manager.fill_bitmask([matcher])[0])
    assert len(free) > 500  # before the trigger: (almost) any text
    for ch in b"hi <f=add>":
        matcher.accept_token(pieces.index(bytes([ch])))
    inside = _allowed(manager.fill_bitmask([matcher])[0])
    assert inside and all(pieces[t][:1].isdigit() or pieces[t][:1].isspace() for t in inside)


def test_caching_is_per_form_and_value(manager):
    regex = manager.compile(StructuredOutputsParams(regex="ab"))
    assert manager.compile(StructuredOutputsParams(regex="ab")) is regex
    assert manager.compile(StructuredOutputsParams(choice=["ab"])) is not regex
    assert manager.compile(StructuredOutputsParams(structural_tag=TAG)) is manager.compile(
        StructuredOutputsParams(structural_tag=json.dumps(TAG)))


# -- refusals ---------------------------------------------------------------------
@pytest.mark.parametrize("form, param, named", [
    ({"regex": r"(?=a)a"}, "structured_outputs.regex", "lookaround"),
    ({"regex": r"\bword"}, "structured_outputs.regex", "word boundaries"),
    ({"regex": r"[a-"}, "structured_outputs.regex", "not a valid regular expression"),
    ({"regex": r"()"}, "structured_outputs.regex", "allows only the empty output"),
    ({"grammar": 'root ::= "a" | '}, "structured_outputs.grammar", "EBNF parser error"),
    ({"grammar": 'start ::= "a"'}, "structured_outputs.grammar", 'root rule with name "root" is not found'),
    ({"grammar": "root ::= undefined_rule"}, "structured_outputs.grammar", "not defined"),
    ({"structural_tag": {"type": "structural_tag", "format": {"type": "nope"}}},
     "structured_outputs.structural_tag", "Format type not recognized"),
    ({"structural_tag": {"type": "structural_tag", "triggers": ["<"], "structures": [{"begin": "<a>", "schema": {}}]}},
     "structured_outputs.structural_tag", "missing 'end'"),
    ({"structural_tag": {"type": "structural_tag", "format": {
        "type": "tag", "begin": "<a>", "end": "</a>",
        "content": {"type": "json_schema", "json_schema": {"type": "array", "contains": {"const": 1}}}}}},
     "structured_outputs.structural_tag", "'contains'"),
    ({"structural_tag": {"type": "structural_tag", "format": {"type": "regex", "pattern": "(?=x)x"}}},
     "structured_outputs.structural_tag", "lookaround"),
])
def test_uncompilable_forms_are_refused_naming_the_field(manager, form, param, named):
    with pytest.raises(InvalidRequestError, match=re.escape(named)) as info:
        manager.compile(StructuredOutputsParams(**form))
    assert info.value.param == param
    assert "/project/" not in str(info.value)  # xgrammar's log prefix is cleaned off
    if named != "allows only the empty output":  # that one needs the tokenizer's matcher
        with pytest.raises(InvalidRequestError, match=re.escape(named)) as info:
            check_form(StructuredOutputsParams(**form))  # what a batch job checks before it starts
        assert info.value.param == param


def test_engine_refuses_before_admitting(engines):
    llm = engines[False]
    with pytest.raises(InvalidRequestError) as info:
        llm.generate(["x"], SamplingParams(structured_outputs=StructuredOutputsParams(regex=r"(a)\1")), use_tqdm=False)
    assert info.value.param == "structured_outputs.regex"
    assert not llm.llm_engine.has_unfinished_requests()


# -- reasoning models: the grammar constrains the answer after </think> ---------------------
DIGITS = StructuredOutputsParams(regex=r"[0-9]{3}")


@pytest.fixture(scope="module")
def thinking(tiny_qwen3_tools):
    """async_scheduling -> an engine with the qwen3 reasoning parser; <think> and </think> are single tokens."""
    return {overlap: LLM(tiny_qwen3_tools, dtype="float32", device="cpu", reasoning_parser="qwen3",
                         async_scheduling=overlap) for overlap in (False, True)}


def _think_ids(llm) -> tuple[int, int]:
    tok = llm.get_tokenizer()
    return tok.convert_tokens_to_ids("<think>"), tok.convert_tokens_to_ids("</think>")


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlapped"])
def test_grammar_starts_after_the_thinking_ends(thinking, overlap):
    llm = thinking[overlap]
    start, end = _think_ids(llm)
    prompt = {"prompt_token_ids": [5, 6, 7, start]}
    base = {"temperature": 1.0, "n": 2, "max_tokens": 12, "ignore_eos": True, "structured_outputs": DIGITS}
    ends, never, closed = llm.generate([prompt, prompt, {"prompt_token_ids": [5, 6, 7, start, 9, end]}], [
        SamplingParams(seed=0, logit_bias={end: 100}, **base),   # </think> forced as the first output token
        SamplingParams(seed=1, logit_bias={end: -100}, **base),  # the thinking never ends
        SamplingParams(seed=2, **base),                          # the prompt closed the thinking
    ], use_tqdm=False)
    for c in ends.outputs:  # the grammar took over after </think>, which it never saw
        assert c.token_ids[0] == end and c.finish_reason == "stop"
        assert re.fullmatch(r"</think>[0-9]{3}", c.text), c.text
    for c in never.outputs:  # unconstrained all along: the random model writes anything
        assert c.finish_reason == "length" and len(c.token_ids) == 12 and not re.fullmatch(r"[0-9]{3}", c.text)
    for c in closed.outputs:
        assert c.finish_reason == "stop" and re.fullmatch(r"[0-9]{3}", c.text), c.text
    llm.llm_engine.block_manager.check_no_leak()


def test_without_a_reasoning_parser_the_grammar_binds_from_the_first_token(tiny_qwen3_tools):
    llm = LLM(tiny_qwen3_tools, dtype="float32", device="cpu")
    start, end = _think_ids(llm)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7, start]}], SamplingParams(
        temperature=1.0, seed=0, max_tokens=12, logit_bias={end: 100}, structured_outputs=DIGITS), use_tqdm=False)
    assert re.fullmatch(r"[0-9]{3}", out[0].outputs[0].text)  # the grammar banned </think>, bias or not


def test_a_reasoning_parser_needs_its_end_token(tiny_llama):
    with pytest.raises(ValueError, match="'</think>' as one token"):
        LLM(tiny_llama, dtype="float32", device="cpu", reasoning_parser="qwen3")
