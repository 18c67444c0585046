"""engine/errors.py: the engine's exception types, their attributes across processes, check_int."""
import pickle

import pytest

from engine.errors import EngineDeadError, InvalidRequestError, PromptTooLongError, WorkerDiedError, check_int


@pytest.mark.parametrize("err", [InvalidRequestError("top_p=0 is invalid", param="top_p", code="range"),
                                 PromptTooLongError("prompt (60 tokens) exceeds max_model_len=64")])
def test_pickling_keeps_type_message_param_and_code(err):  # Ray pickles exceptions between processes
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is type(err) and str(back) == str(err)
    assert (back.param, back.code) == (err.param, err.code)


def test_refusals_stay_value_errors_and_deaths_runtime_errors():
    too_long = PromptTooLongError("too long")
    assert isinstance(too_long, InvalidRequestError) and isinstance(too_long, ValueError)
    assert (too_long.param, too_long.code) == ("prompt", "context_length_exceeded")
    assert issubclass(WorkerDiedError, EngineDeadError) and issubclass(EngineDeadError, RuntimeError)


@pytest.mark.parametrize("value", [0, -1, 1.0, True, "2", None])
def test_check_int_refuses_naming_the_value(value):
    with pytest.raises(ValueError, match=rf"^block_size={value!r} is invalid: must be an integer >= 1$"):
        check_int("block_size", value)


def test_check_int_minimum():
    check_int("max_retries", 0, minimum=0)
    check_int("n", 7)
    with pytest.raises(ValueError, match=">= 0"):
        check_int("max_retries", -1, minimum=0)
