"""serve_app.guard.policy: each check, redaction, the policy's own validation, the error body."""
import json
import pickle

import pytest

from serve_app.guard.policy import REDACTED, GuardrailError, GuardrailPolicy, check_output

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "contact": {"type": "string", "format": "email"},
        "items": {"type": "array", "maxItems": 2, "items": {
            "type": "object", "properties": {"qty": {"type": "integer", "maximum": 9}}, "required": ["qty"]}},
    },
    "required": ["name"],
    "additionalProperties": False,
}
POLICY = GuardrailPolicy()
EMAIL = r"[\w.+-]+@[\w-]+\.[\w.]+"


def test_a_valid_document_passes_unchanged():
    text = '{"name":"Ann","items":[{"qty":1}]}'
    result = check_output(text, SCHEMA, json_object=False, policy=POLICY)
    assert result.passed and result.outcome == "passed"
    assert result.text == text and result.document == {"name": "Ann", "items": [{"qty": 1}]}


def test_output_size_limit_in_utf8_bytes():
    policy = GuardrailPolicy(max_output_bytes=10)
    assert check_output('{"a":"é"}', None, True, policy).passed  # 9 characters, 10 bytes
    result = check_output('{"a":"ée"}', None, True, policy)  # 10 characters, 11 bytes: "é" is 2
    assert (result.outcome, result.reason) == ("violation", "max_output_bytes")
    assert "11 bytes" in result.message and "max_output_bytes=10" in result.message


def test_nesting_depth_limit():
    policy = GuardrailPolicy(max_depth=3)
    assert check_output('{"a":[{"b":1}]}', None, True, policy).passed  # depth 3
    result = check_output('{"a":[{"b":[1]}]}', None, True, policy)
    assert result.reason == "max_depth" and "4 levels" in result.message
    very_deep = "[" * 100_000 + "]" * 100_000  # deeper than the parser's stack
    assert check_output(very_deep, None, False, GuardrailPolicy(max_output_bytes=1 << 21)).reason == "max_depth"


@pytest.mark.parametrize("text", ['{"name":"Ann"', '{"name": NaN}', "", '{"a":1} {"b":2}'])
def test_invalid_json(text):
    result = check_output(text, None, True, POLICY)
    assert result.reason == "invalid_json" and result.message.startswith("the output is not valid JSON")


def test_invalid_json_cut_off_by_max_tokens_says_so():
    result = check_output('{"name":"An', SCHEMA, False, POLICY, finish_reason="length")
    assert result.reason == "invalid_json" and "max_tokens cut it off" in result.message


@pytest.mark.parametrize("text, kind", [("[1,2]", "array"), ('"x"', "string"), ("3", "number"), ("null", "null")])
def test_json_object_needs_an_object_at_the_top(text, kind):
    result = check_output(text, None, json_object=True, policy=POLICY)
    assert result.reason == "not_an_object" and result.message.endswith(f"is a {kind}")
    assert check_output(text, None, json_object=False, policy=POLICY).passed  # no contract, no check


@pytest.mark.parametrize("document, path, keyword", [
    ({"name": "Ann", "items": [{"qty": 1}, {"qty": 12}]}, "$.items[1].qty", "maximum"),
    ({"name": "Ann", "items": [{"qty": 1}, {"qty": 2}, {"qty": 3}]}, "$.items", "maxItems"),
    ({"items": []}, "$", "required"),
    ({"name": "Ann", "extra": 1}, "$", "additionalProperties"),
    ({"name": "Ann", "contact": "not an address"}, "$.contact", "format"),  # format checking is on
])
def test_schema_violation_names_the_path_and_keyword(document, path, keyword):
    result = check_output(json.dumps(document), SCHEMA, json_object=False, policy=POLICY)
    assert result.reason == "schema"
    assert f"at {path}: " in result.message and f"('{keyword}')" in result.message


def test_redaction_replaces_matches_in_string_values_only():
    policy = GuardrailPolicy(redact_patterns=[EMAIL, r"\b\d{3}-\d{4}\b"])
    doc = {"a@b.io": "write to ann@example.com or 555-1234", "list": ["x", {"deep": "bob@corp.org"}], "n": 5}
    result = check_output(json.dumps(doc), None, json_object=True, policy=policy)
    assert result.passed
    assert result.document == {"a@b.io": f"write to {REDACTED} or {REDACTED}",  # keys untouched
                               "list": ["x", {"deep": REDACTED}], "n": 5}
    assert json.loads(result.text) == result.document  # the client gets the redacted text


def test_redaction_that_breaks_the_schema_is_a_violation():
    policy = GuardrailPolicy(redact_patterns=[EMAIL])
    result = check_output('{"name":"Ann","contact":"ann@example.com"}', SCHEMA, False, policy)
    assert result.reason == "schema" and result.message.startswith("after redaction")


@pytest.mark.parametrize("kwargs, named", [
    ({"redact_patterns": ["(unclosed"]}, "redact_patterns[0]='(unclosed' is not a valid regex"),
    ({"redact_patterns": ["ok", "a*"]}, "redact_patterns[1]='a*' matches the empty string"),
    ({"redact_patterns": "a+"}, "must be a list"),
    ({"max_output_bytes": 0}, "max_output_bytes=0"),
    ({"max_depth": True}, "max_depth=True"),
    ({"max_depth": 10_000}, "max_depth=10000 is invalid: must be <= 256"),
    ({"max_retries": -1}, "max_retries=-1"),
])
def test_bad_policy_is_refused_at_start(kwargs, named):
    with pytest.raises(ValueError, match=named.replace("[", r"\[").replace("(", r"\(").replace("*", r"\*")):
        GuardrailPolicy(**kwargs)


def test_policy_from_args():
    policy = GuardrailPolicy.from_args({"max_retries": 0, "redact_patterns": None})
    assert policy.max_retries == 0 and policy.redact_patterns == ()
    assert GuardrailPolicy.from_args(None) == GuardrailPolicy()
    with pytest.raises(ValueError, match="max_retry"):
        GuardrailPolicy.from_args({"max_retry": 1})


def test_error_body_is_openai_shaped():
    result = check_output('{"name":1}', SCHEMA, False, POLICY)
    err = GuardrailError.from_result(result, attempts=3)
    assert err.status_code == 422
    body = err.body()["error"]
    assert body["type"] == "guardrail_violation" and body["code"] == "schema" and body["param"] == "response_format"
    assert "after 3 attempt(s)" in body["message"] and "at $.name: 1 is not of type 'string'" in body["message"]
    copy = pickle.loads(pickle.dumps(err))  # crosses Ray's process boundary as itself
    assert isinstance(copy, GuardrailError) and copy.body() == err.body() and copy.status_code == 422
    with pytest.raises(ValueError):
        GuardrailError.from_result(check_output("{}", None, True, POLICY), attempts=1)
