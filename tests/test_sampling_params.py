"""engine/sampling_params.py: a bad value is an InvalidRequestError naming its field in `param`."""
import pytest

from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams, StructuredOutputsParams


@pytest.mark.parametrize("kwargs,param", [
    ({"n": 0}, "n"), ({"temperature": -0.5}, "temperature"), ({"top_p": 1.5}, "top_p"), ({"top_k": -2}, "top_k"),
    ({"min_p": 2.0}, "min_p"), ({"max_tokens": 0}, "max_tokens"), ({"min_tokens": 3, "max_tokens": 2}, "min_tokens"),
    ({"logprobs": 21}, "logprobs"), ({"prompt_logprobs": -1}, "prompt_logprobs"), ({"stop": [""]}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"), ({"repetition_penalty": 0.0}, "repetition_penalty"),
])
def test_bad_values_name_their_field(kwargs, param):
    with pytest.raises(InvalidRequestError, match=rf"^{param}=") as info:
        SamplingParams(**kwargs)
    assert info.value.param == param


@pytest.mark.parametrize("kwargs,param", [({}, "structured_outputs"), ({"json": "{oops"}, "structured_outputs.json"),
                                          ({"json": 3}, "structured_outputs.json")])
def test_bad_structured_outputs(kwargs, param):
    with pytest.raises(InvalidRequestError) as info:
        StructuredOutputsParams(**kwargs)
    assert info.value.param == param


@pytest.mark.parametrize("kwargs,param", [
    ({"json": {}, "regex": "a"}, "structured_outputs"),            # two forms at once
    ({"json_object": True, "choice": ["a"]}, "structured_outputs"),
    ({"regex": ""}, "structured_outputs.regex"), ({"regex": 3}, "structured_outputs.regex"),
    ({"choice": []}, "structured_outputs.choice"), ({"choice": ["a", ""]}, "structured_outputs.choice"),
    ({"choice": ["a", "a"]}, "structured_outputs.choice"), ({"choice": "ab"}, "structured_outputs.choice"),
    ({"grammar": "  "}, "structured_outputs.grammar"),
    ({"structural_tag": "{not json"}, "structured_outputs.structural_tag"),
    ({"structural_tag": {"type": "json_schema"}}, "structured_outputs.structural_tag"),
    ({"structural_tag": {"type": "structural_tag", "structures": []}}, "structured_outputs.structural_tag"),
])
def test_bad_forms_name_their_field(kwargs, param):
    with pytest.raises(InvalidRequestError) as info:
        StructuredOutputsParams(**kwargs)
    assert info.value.param == param


def test_forms_and_keys():
    regex = StructuredOutputsParams(regex="a+")
    assert (regex.form, regex.key()) == ("regex", 'regex:"a+"')
    tag = {"type": "structural_tag", "format": {"type": "const_string", "value": "x"}}
    assert StructuredOutputsParams(structural_tag=tag).key() == StructuredOutputsParams(
        structural_tag='{"format": {"value": "x", "type": "const_string"}, "type": "structural_tag"}').key()
    assert StructuredOutputsParams(choice=("a", "b")).choice == ["a", "b"]
    assert StructuredOutputsParams(json_object=True).key() == "json_object"
    keys = {StructuredOutputsParams(**{f: v}).key() for f, v in
            [("regex", "a"), ("grammar", "a"), ("choice", ["a"]), ("json", {"const": "a"})]}
    assert len(keys) == 4  # the same text under two forms is two grammars


@pytest.mark.parametrize("kwargs,param", [
    ({"logit_bias": {"12": 101}}, "logit_bias"), ({"logit_bias": {5: float("nan")}}, "logit_bias"),
    ({"logit_bias": {"-1": 1.0}}, "logit_bias"), ({"logit_bias": {"abc": 1.0}}, "logit_bias"),
    ({"logit_bias": {True: 1.0}}, "logit_bias"), ({"logit_bias": {1: "2"}}, "logit_bias"),
    ({"logit_bias": [1, 2]}, "logit_bias"), ({"logit_bias": {"1": 1.0, 1: 2.0}}, "logit_bias"),
    ({"allowed_token_ids": []}, "allowed_token_ids"), ({"allowed_token_ids": [1, -2]}, "allowed_token_ids"),
    ({"bad_words": ["ok", " "]}, "bad_words"), ({"bad_words": "word"}, "bad_words"),
])
def test_bad_token_controls_name_their_field(kwargs, param):
    with pytest.raises(InvalidRequestError, match=rf"^{param}=") as info:
        SamplingParams(**kwargs)
    assert info.value.param == param


def test_logit_bias_keys_become_ints():
    assert SamplingParams(logit_bias={"12": 5, 3: -100, "7": 0.5}).logit_bias == {12: 5.0, 3: -100.0, 7: 0.5}
