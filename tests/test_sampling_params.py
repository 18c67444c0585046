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
