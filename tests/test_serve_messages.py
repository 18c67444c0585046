"""The messages between deployments: a StreamError's kind is one of a closed set."""
import pickle

import pytest

from serve_app.http.messages import ErrorKind, StreamError


def test_stream_error_kind_is_checked_and_compares_as_its_string():
    err = StreamError("overloaded", "at capacity")
    assert err.kind is ErrorKind.OVERLOADED and err.kind == "overloaded"
    assert pickle.loads(pickle.dumps(err)) == err


def test_stream_error_refuses_an_unknown_kind():
    with pytest.raises(ValueError, match=r"kind='overload' is invalid: choose one of .*'overloaded'"):
        StreamError("overload", "at capacity")


def test_the_docstring_lists_every_kind():  # it once missed "overloaded"
    assert all(f'"{kind.value}"' in StreamError.__doc__ for kind in ErrorKind)
