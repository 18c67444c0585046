"""OpenAI error bodies and the mapping of engine exceptions, by type, to statuses (no Ray)."""
import pickle

import pytest

from engine.errors import EngineDeadError, InvalidRequestError, PromptTooLongError, WorkerDiedError
from engine.sampling_params import SamplingParams
from serve_app.http.errors import (ERROR_TABLE, OpenAIError, body_too_large, from_stream_error, from_value_error,
                              model_not_found, overloaded, stream_error, unauthorized)
from serve_app.guard.policy import GuardrailError
from serve_app.http.messages import ErrorKind, StreamError


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


def test_engine_errors_are_mapped_by_type_not_wording():
    # The same text as an untyped ValueError names no param; typed, the engine's param is kept.
    text = "token id 5000 is out of vocabulary (vocab_size=1024)"
    assert from_value_error(ValueError(text)).param is None
    assert from_value_error(InvalidRequestError(text, param="prompt")).param == "prompt"
    err = from_value_error(ValueError("the prompt is empty (0 tokens)"))
    assert err.status_code == 400


def test_an_untyped_value_error_falls_back_to_its_leading_field_name():
    assert from_value_error(ValueError("max_tokens=9 is too large")).param == "max_tokens"
    assert from_value_error(ValueError("request_id 'x' is already in use")).param is None  # not a request field


@pytest.mark.parametrize("exc,status,type_,param,code", [
    (InvalidRequestError("top_p=0 is invalid", param="top_p"), 400, "invalid_request_error", "top_p", None),
    (PromptTooLongError("prompt (60 tokens) + max_tokens (5) exceeds max_model_len=64"), 400,
     "invalid_request_error", "prompt", "context_length_exceeded"),
    (InvalidRequestError("'contains' is not supported", param="structured_outputs"), 400,
     "invalid_request_error", "response_format", None),  # the engine's field, by its OpenAI name
    (ValueError("temperature=-1 is invalid"), 400, "invalid_request_error", "temperature", None),
    (EngineDeadError("the engine loop died"), 503, "service_unavailable", None, "service_unavailable"),
    (WorkerDiedError("TP worker rank 1 exited"), 503, "service_unavailable", None, "service_unavailable"),
    (RuntimeError("CUDA error: illegal address"), 500, "server_error", None, "internal_error"),
])
def test_each_exception_type_has_its_status(exc, status, type_, param, code):
    err = from_stream_error(pickle.loads(pickle.dumps(stream_error(exc))), retry_after_s=3)  # crosses Ray
    body = err.body()["error"]
    assert (err.status_code, body["type"], body["param"], body["code"]) == (status, type_, param, code)
    assert ("Retry-After" in err.headers) == (status == 503)
    if status == 500:  # the exception's text is for the logs, not the client
        assert "CUDA" not in body["message"]


def test_the_table_covers_every_kind_and_agrees_with_the_guardrail():
    assert set(ERROR_TABLE) == set(ErrorKind)
    assert ERROR_TABLE[ErrorKind.GUARDRAIL_VIOLATION][:2] == (GuardrailError.STATUS, GuardrailError.TYPE)
    overloaded_err = from_stream_error(StreamError("overloaded", "at capacity"), retry_after_s=2)
    assert overloaded_err.status_code == 503 and overloaded_err.headers == {"Retry-After": "2"}


def test_survives_pickling():  # errors cross Ray process boundaries
    err = pickle.loads(pickle.dumps(overloaded("busy", 4)))
    assert isinstance(err, OpenAIError) and err.status_code == 503 and err.headers["Retry-After"] == "4"
