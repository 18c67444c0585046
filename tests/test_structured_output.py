"""engine.core.structured_output: schema checks, the bitmask, the matcher, then JSON end to end.

The tiny model has random weights, so only the grammar can make it write JSON: every
document below that parses and validates does so because of the bitmask.
"""
import concurrent.futures
import json
import re

import jsonschema
import pytest
import torch
import xgrammar as xgr

from engine import LLM, SamplingParams, StructuredOutputsParams
from engine.core.structured_output import StructuredOutputManager
from engine.worker.sampler import _apply_token_bitmask_torch, apply_token_bitmask

# Nested, with everything the issue lists: objects, arrays with maxItems, enums, integer and
# number ranges, nullable fields, additionalProperties false, required. maxLength keeps the
# random model's strings short.
ORDER = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 999},
        "status": {"enum": ["new", "paid", "shipped"]},
        "total": {"type": "number", "minimum": 0, "maximum": 100},
        "note": {"type": ["string", "null"], "maxLength": 5},
        "items": {"type": "array", "maxItems": 2, "items": {
            "type": "object",
            "properties": {"sku": {"type": "string", "maxLength": 4},
                           "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["sku", "qty"], "additionalProperties": False}},
    },
    "required": ["id", "status", "items"],
    "additionalProperties": False,
}
VALIDATOR = jsonschema.Draft202012Validator(ORDER, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)


def _json(schema=None) -> StructuredOutputsParams:
    return StructuredOutputsParams(json=schema) if schema is not None else StructuredOutputsParams(json_object=True)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    # A cache of 14 blocks (224 tokens) for a batch that wants far more: preemption is certain.
    return LLM(tiny_llama, dtype="float32", device="cpu", num_kv_blocks=14, max_num_batched_tokens=256)


@pytest.fixture(scope="module")
def manager(llm) -> StructuredOutputManager:
    return llm.llm_engine.structured_outputs  # built once per tokenizer: the costly part


@pytest.fixture(scope="module")
def tok(llm):
    return llm.get_tokenizer()


def _ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def _allowed(row: torch.Tensor) -> set[int]:
    return {32 * w + j for w, word in enumerate(row.tolist()) for j in range(32) if (word >> j) & 1}


# -- compile -------------------------------------------------------------------
def test_compile_is_cached_per_schema(manager, tok):
    first = manager.compile(_json(ORDER))
    assert manager.compile(_json(json.dumps(ORDER))) is first  # same schema given as JSON text
    assert manager.compile(_json({"type": "integer"})) is not first
    small = StructuredOutputManager(tok, manager.num_words * 32, max_cached_grammars=1)  # vocab 1024
    a = small.compile(_json({"type": "integer"}))
    small.compile(_json({"type": "boolean"}))  # evicts the least recently used
    assert small.compile(_json({"type": "integer"})) is not a


def test_compile_from_many_threads(manager):
    # The engine compiles on worker threads; the cache must stay consistent under that.
    schemas = [{"type": "array", "items": {"type": "integer"}, "maxItems": k % 4 + 1} for k in range(16)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        compiled = list(pool.map(lambda s: manager.compile(_json(s)), schemas))
    assert all(manager.compile(_json(s)) is c for s, c in zip(schemas[-4:], compiled[-4:]))


@pytest.mark.parametrize("schema, where", [
    ({"type": "objekt"}, "#/type"),
    ({"properties": {"a": {"minimum": "3"}}}, "#/properties/a/minimum"),
    ({"required": "a"}, "#/required"),
])
def test_invalid_schema_is_a_value_error(manager, schema, where):
    with pytest.raises(ValueError, match=f"invalid JSON Schema at {where}") as info:
        manager.compile(_json(schema))
    assert info.value.param == "structured_outputs"  # an InvalidRequestError: the HTTP tier's response_format


@pytest.mark.parametrize("schema, named", [
    ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 3}}, "'contains' (at #)"),
    ({"type": "object", "properties": {"p": {"type": "object", "properties": {"a": {}, "b": {}},
                                             "dependentSchemas": {"a": {"required": ["b"]}}}}},
     "'dependentSchemas' (at #/properties/p)"),
    ({"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}, "'if'"),
    ({"allOf": [{"type": "object"}, {"required": ["a"]}]}, "'allOf'"),
    ({"type": "object", "properties": {"a": {}}, "anyOf": [{"required": ["a"]}]}, "'anyOf' next to 'properties'"),
    ({"$ref": "https://example.com/schema.json"}, "'$ref'"),
    ({"type": "object", "properties": {"a": {}}, "required": ["b"]}, ("'required' (at #) is not supported by "
                                                                       "grammar-constrained decoding: it names 'b'")),
    ({"type": "integer", "minimum": 5, "maximum": 1}, "minimum greater than maximum"),
    ({"type": "string", "pattern": "^(a)\\1$"}, "Backreference"),
])
def test_unsupported_parts_are_refused_by_name(manager, schema, named):
    with pytest.raises(ValueError, match=re.escape(named)) as info:
        manager.compile(_json(schema))
    assert info.value.param == "structured_outputs"


@pytest.mark.parametrize("schema", [
    {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},  # checked by the guardrail
    {"type": "number", "multipleOf": 0.5},                                 # checked by the guardrail
    {"type": "integer", "not": {"const": 3}},                              # checked by the guardrail
    {"type": "string", "pattern": "^[a-z]+$", "maxLength": 3},             # length checked by the guardrail
    {"type": "string", "format": "color"},                                 # unknown format: guardrail
    {"type": "object", "patternProperties": {"^x_": {"type": "integer"}}},
    {"type": "object", "properties": {"contains": {"type": "integer"}}},   # a property, not the keyword
    {"$defs": {"n": {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/n"}}}}},
     "$ref": "#/$defs/n", "description": "a tree"},
    {"anyOf": [{"type": "string"}, {"type": "null"}], "title": "nullable", "maxLength": 3},
])
def test_enforced_or_validated_parts_compile(manager, schema):
    manager.compile(_json(schema))


# -- bitmask and matcher ---------------------------------------------------------
def test_bitmask_layout_matches_xgrammar(manager, tok):
    matcher = manager.new_matcher(manager.compile(_json(ORDER)))
    bitmask = manager.fill_bitmask([matcher, None])
    vocab = manager.num_words * 32
    assert bitmask.dtype == torch.int32 and bitmask.device.type == "cpu"
    assert bitmask.shape == (2, (vocab + 31) // 32)
    assert bitmask[1].eq(-1).all()  # an unconstrained row allows everything
    allowed = _allowed(bitmask[0])
    assert allowed and all(tok.decode([t]).startswith("{") for t in allowed)
    assert not allowed & set(range(len(tok), vocab))  # the model's padding ids are never allowed
    # The sampler's masking (xgrammar's kernel on CPU, torch ops elsewhere) equals xgrammar's own.
    logits = torch.randn(2, vocab)
    ours, torch_ops, theirs = logits.clone(), logits.clone(), logits.clone()
    apply_token_bitmask(ours, bitmask)
    _apply_token_bitmask_torch(torch_ops, bitmask)
    xgr.apply_token_bitmask_inplace(theirs, bitmask)
    assert torch.equal(ours, theirs) and torch.equal(torch_ops, theirs)


def test_matcher_walks_a_valid_document_and_finishes(manager, tok):
    matcher = manager.new_matcher(manager.compile(_json(ORDER)))
    ids = _ids(tok, '{"id": 12, "status": "paid", "items": [{"sku": "ab", "qty": 3}]}')
    for t in ids:
        assert not matcher.is_finished()
        assert t in _allowed(manager.fill_bitmask([matcher])[0])
        matcher.accept_token(t)
    assert matcher.is_finished()  # the object is closed: only a stop token could follow
    assert manager.fill_bitmask([matcher])[0].eq(-1).all()  # finished rows never mask everything
    with pytest.raises(RuntimeError, match="not allowed by the grammar"):
        manager.new_matcher(manager.compile(_json(ORDER))).accept_token(_ids(tok, "[")[0])


def test_batched_fill_equals_one_row_at_a_time(manager, tok):
    """Several stale rows are filled by xgrammar's batch matcher in one call: the same masks
    (writable filter included) as filling each matcher alone, and finished rows stay all-ones."""
    doc = '{"id": 12, "status": "paid", "items": [{"sku": "ab", "qty": 3}]}'
    ids = _ids(tok, doc)
    grammars = [_json(ORDER), _json({"type": "string", "maxLength": 5}), _json()]
    batch = [manager.new_matcher(manager.compile(g)) for g in grammars] + [None]
    alone = [manager.new_matcher(manager.compile(g)) for g in grammars]
    prefixes = [ids[:7], _ids(tok, '"')[:1], _ids(tok, "{")[:1]]
    for m_batch, m_alone, prefix in zip(batch, alone, prefixes):
        for t in prefix:
            m_batch.accept_token(t)
            m_alone.accept_token(t)
    filled = manager.fill_bitmask(batch)
    for i, m in enumerate(alone):
        assert torch.equal(filled[i], manager.fill_bitmask([m])[0]), i
    assert filled[3].eq(-1).all()
    done = manager.new_matcher(manager.compile(_json(ORDER)))
    for t in ids:
        done.accept_token(t)
    assert manager.fill_bitmask([done, batch[0]])[0].eq(-1).all()


@pytest.mark.parametrize("fill", ["serial", "batched"])
def test_step_bitmask_equals_each_matchers_own_mask_along_documents(manager, tok, monkeypatch, fill):
    """fill_bitmask writes stale rows straight into the step's bitmask (xgrammar's batch matcher on
    a machine with cores to spare, the step thread otherwise) and copies the masks a matcher still
    holds (is_finished() fills one when the document could end): at every token of several
    documents, each row equals a fresh matcher's own mask for the same prefix."""
    if fill == "batched":
        monkeypatch.setattr(manager, "_batch_matcher", xgr.BatchGrammarMatcher(max_threads=2))
        monkeypatch.setattr(manager, "_fill_rows", manager._fill_batched)
    else:
        monkeypatch.setattr(manager, "_fill_rows", manager._fill_serial)
    docs = [(_json(ORDER), '{"id": 12, "status": "paid", "items": [{"sku": "ab", "qty": 3}]}'),
            (StructuredOutputsParams(regex=r"(ab\n|[0-9]+\t)+"), "ab\n12\tab\n"),  # keeps control bytes
            (_json({"type": "integer"}), "1234"),  # complete after every digit: is_finished() fills
            (_json({"type": "string", "maxLength": 5}), '"x y"')]
    walks = [(params, _ids(tok, text)) for params, text in docs]
    batch = [manager.new_matcher(manager.compile(params)) for params, _ in walks] + [None]
    for step in range(max(len(ids) for _, ids in walks) + 1):
        for m in batch[:-1]:
            m.is_finished()  # as the engine asks after each token
        filled = manager.fill_bitmask(batch)
        for row, (params, ids) in enumerate(walks):
            fresh = manager.new_matcher(manager.compile(params))
            for t in ids[:step]:
                fresh.accept_token(t)
            expected = torch.full_like(filled[row], -1) if fresh.is_finished() else fresh.next_token_mask()
            assert torch.equal(filled[row], expected), (row, step)
            if step < len(ids):
                batch[row].accept_token(ids[step])
        assert filled[-1].eq(-1).all()


def test_a_number_that_may_grow_is_not_finished(manager, tok):
    matcher = manager.new_matcher(manager.compile(_json({"type": "integer"})))
    for t in _ids(tok, "12"):
        matcher.accept_token(t)
    assert not matcher.is_finished()  # complete, but "123" is still possible
    allowed = _allowed(manager.fill_bitmask([matcher])[0])
    assert set(manager.stop_token_ids) <= allowed
    matcher.accept_token(manager.stop_token_ids[0])
    assert matcher.is_finished()


def test_no_control_bytes_or_special_tokens_inside_strings(manager, tok):
    # xgrammar 0.2.8 lets raw U+0000-U+001F into strings with maxLength (mlc-ai/xgrammar#800);
    # a special token would vanish from the detokenized text. Neither may be sampled.
    matcher = manager.new_matcher(manager.compile(_json({"type": "string", "maxLength": 5})))
    matcher.accept_token(_ids(tok, '"')[0])
    allowed = _allowed(manager.fill_bitmask([matcher])[0])
    assert len(allowed) > 100  # ordinary string characters remain
    pieces = manager.tokenizer_info.decoded_vocab  # a fresh list per access: read it once
    assert not any(b < 0x20 for t in allowed for b in pieces[t])
    assert not allowed & (set(tok.all_special_ids) - set(manager.stop_token_ids))


# -- end to end through the engine ---------------------------------------------
def _texts(outs) -> list[str]:
    return [c.text for out in outs for c in out.outputs]


def test_nested_schema_at_temperature_one_with_n_and_preemption(llm):
    params = [SamplingParams(temperature=1.0, seed=seed, n=2, max_tokens=120, structured_outputs=_json(ORDER))
              for seed in range(3)]
    preempted_before = llm.llm_engine.scheduler.num_preemptions
    outs = llm.generate(["Order:", "Give me JSON", "Order:"], params, use_tqdm=False)  # + prefix cache hits
    assert all(c.finish_reason == "stop" for out in outs for c in out.outputs)
    for text in _texts(outs):
        VALIDATOR.validate(json.loads(text))
    assert len(set(_texts(outs))) > 1  # temperature 1.0 did sample
    assert llm.llm_engine.scheduler.num_preemptions > preempted_before, "the small cache should have forced preemption"
    llm.llm_engine.block_manager.check_no_leak()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_nested_schema_on_cuda(tiny_llama):
    """The bitmask on GPU logits, bf16 and CUDA graphs: the same contract as on CPU."""
    llm = LLM(tiny_llama, device="cuda", gpu_memory_utilization=0.3)
    params = [SamplingParams(temperature=1.0, seed=seed, n=2, max_tokens=120, structured_outputs=_json(ORDER))
              for seed in range(4)]
    outs = llm.generate(["Order:", "Give me JSON", "Order:", "x"], params, use_tqdm=False)
    assert all(c.finish_reason == "stop" for out in outs for c in out.outputs)
    for text in _texts(outs):
        VALIDATOR.validate(json.loads(text))
    llm.llm_engine.block_manager.check_no_leak()


# json_object on a random model: a key ends only when one of ~2 closing-quote tokens out of
# 1000 is drawn, so most documents run past any small max_tokens. These single-token prompts
# make the tiny model's greedy choice close the object at once (found by trying all of them);
# the sampled ones may or may not finish. Every output must still be an object's prefix.
GREEDY_CLOSERS = ["a", "role", "mess"]
PLAIN = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def mixed_batch(llm, tok):
    """One batch: a plain greedy request among json_object and json_schema requests."""
    greedy = SamplingParams(temperature=0.0, max_tokens=12, structured_outputs=_json())
    prompts = [{"prompt_token_ids": _ids(tok, word)} for word in GREEDY_CLOSERS]
    params = [greedy] * len(prompts)
    prompts += ["hello"] * 6
    params += [SamplingParams(temperature=1.0, seed=seed, max_tokens=12, structured_outputs=_json())
               for seed in range(6)]
    prompts += ["Order:", "The plain request"]
    # ignore_eos: the scheduler would never stop it; the grammar's end of document must.
    params += [SamplingParams(temperature=1.0, seed=7, max_tokens=160, ignore_eos=True, structured_outputs=_json(ORDER)),
               PLAIN]
    return llm.generate(prompts, params, use_tqdm=False)


def test_json_object_parses_to_an_object(manager, mixed_batch):
    completions = [out.outputs[0] for out in mixed_batch[:-2]]
    done = [c.text for c in completions if c.finish_reason == "stop"]
    assert len(done) >= len(GREEDY_CLOSERS), done
    assert all(isinstance(json.loads(text), dict) for text in done)
    for c in completions:  # cut or not, the grammar held at every token
        matcher = manager.new_matcher(manager.compile(_json()))
        for t in c.token_ids:
            matcher.accept_token(t)
        assert c.text.startswith("{")



def test_schema_request_ends_with_its_document_even_with_ignore_eos(mixed_batch):
    completion = mixed_batch[-2].outputs[0]
    assert completion.finish_reason == "stop"
    VALIDATOR.validate(json.loads(completion.text))


def test_plain_greedy_unchanged_next_to_json(llm, mixed_batch):
    alone = llm.generate(["The plain request"], PLAIN, use_tqdm=False)[0].outputs[0]
    batched = mixed_batch[-1].outputs[0]
    assert batched.token_ids == alone.token_ids and batched.finish_reason == "length"


def test_max_tokens_too_small_ends_with_length(llm):
    out = llm.generate(["Order:"], SamplingParams(max_tokens=3, structured_outputs=_json(ORDER)), use_tqdm=False)
    completion = out[0].outputs[0]
    assert completion.finish_reason == "length" and len(completion.token_ids) == 3
    with pytest.raises(json.JSONDecodeError):
        json.loads(completion.text)  # the guardrail's job: retry or a clear error, never a 200


def test_engine_refuses_unsupported_schema_up_front(llm):
    bad = SamplingParams(structured_outputs=_json({"type": "array", "contains": {"type": "integer"}}))
    with pytest.raises(ValueError, match="'contains'"):
        llm.generate(["x"], bad, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
