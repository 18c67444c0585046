"""OpenAI error bodies and the mapping of engine / sampling ValueErrors to 400s (no Ray)."""
import pickle

import pytest

from engine.sampling_params import SamplingParams
from serve_app.errors import OpenAIError, body_too_large, from_value_error, model_not_found, overloaded, unauthorized


def test_body_shape():
    body = model_not_found("gpt-9").body()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["param"] == "model" and "gpt-9" in body["error"]["message"]


@pytest.mark.parametrize("make,status", [(unauthorized, 401), (lambda: model_not_found("x"), 404),
                                         (lambda: body_too_large(10), 413), (lambda: overloaded("busy", 2), 503),
                                         (lambda: overloaded("busy", 2, 429), 429)])
def test_statuses(make, status):
    assert make().status_code == status


def test_overloaded_has_retry_after():
    assert overloaded("busy", 3).headers == {"Retry-After": "3"}


@pytest.mark.parametrize("kwargs,param", [({"temperature": -1.0}, "temperature"), ({"top_p": 0.0}, "top_p"),
                                          ({"n": 0}, "n"), ({"min_tokens": 5, "max_tokens": 2}, "min_tokens")])
def test_sampling_params_errors_become_400_naming_the_field(kwargs, param):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    err = from_value_error(info.value)
    assert err.status_code == 400 and err.param == param


def test_engine_messages():
    assert from_value_error(ValueError("token id 5000 is out of vocabulary (vocab_size=1024)")).param == "prompt"
    err = from_value_error(ValueError("the prompt is empty (0 tokens)"))
    assert err.status_code == 400


def test_survives_pickling():  # errors cross Ray process boundaries
    err = pickle.loads(pickle.dumps(overloaded("busy", 4)))
    assert isinstance(err, OpenAIError) and err.status_code == 503 and err.headers["Retry-After"] == "4"
