"""serve_app.batch.prompts and .config: rows to prompts, without Ray."""
import copy
import re

import pytest

from serve_app.batch.config import BatchConfig, row_seed
from engine import LoRARequest
from serve_app.batch.prompts import (build_prompts, check_columns, load_tokenizer, render_prompt, row_lora,
                                     tokenize_prompts)


def test_template_renders_the_rows_columns(tiny_llama):
    config = BatchConfig(model=tiny_llama, template="Title: {{ title }}\nBody: {{ body | upper }}")
    assert render_prompt(config, {"id": 1, "title": "a", "body": "b"}) == "Title: a\nBody: B"


def test_template_variable_absent_from_a_row_is_named(tiny_llama):
    config = BatchConfig(model=tiny_llama, template="{{ title }} {{ body }}")
    with pytest.raises(ValueError, match=r"row id=7: template variable\(s\) \['body'\] absent"):
        render_prompt(config, {"id": 7, "title": "a", "body": None})


def test_missing_column_is_named_before_any_row(tiny_llama):
    config = BatchConfig(model=tiny_llama, template="{{ title }} {{ body }}", id_column="key")
    with pytest.raises(ValueError, match=r"input.jsonl has no column\(s\) \['body', 'key'\]"):
        check_columns(config, ["title"], "input.jsonl")


def test_bad_template_and_empty_prompt_are_refused(tiny_llama):
    with pytest.raises(ValueError, match="does not parse"):
        render_prompt(BatchConfig(model=tiny_llama, template="{{ x "), {"id": 0, "x": 1})
    with pytest.raises(ValueError, match="column 'prompt' must be a non-empty string"):
        render_prompt(BatchConfig(model=tiny_llama), {"id": 0, "prompt": ""})


def test_prompts_tokenize_as_the_engine_does(tiny_qwen2):
    tok = load_tokenizer(tiny_qwen2)
    config = BatchConfig(model=tiny_qwen2)
    plain = build_prompts(config, None, [{"id": 0, "prompt": "hello there"}])  # no chat: no tokenizer needed
    assert tokenize_prompts(config, tok, plain) == [tok.encode("hello there")]
    config = BatchConfig(model=tiny_qwen2, chat=True)
    chat = build_prompts(config, tok, [{"id": 0, "prompt": "hi"}])
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat[0]["prompt"] == text
    assert tokenize_prompts(config, tok, chat) == [tok.encode(text, add_special_tokens=False)]


def test_rows_the_chat_template_refuses_or_that_tokenize_to_nothing_are_named(tiny_qwen2):
    tok = load_tokenizer(tiny_qwen2)
    config = BatchConfig(model=tiny_qwen2, chat=True)
    with pytest.raises(ValueError, match="row id=1: the chat template cannot render it: no bad words"):
        build_prompts(config, _picky(tok), [{"id": 0, "prompt": "fine"}, {"id": 1, "prompt": "bad"}])
    with pytest.raises(ValueError, match="row id=2: The prompt is empty"):
        tokenize_prompts(config, tok, [{"id": 2, "prompt": ""}])


def _picky(tok):
    """A copy of `tok` whose chat template refuses the prompt 'bad', as templates refuse what they cannot render."""
    tok = copy.deepcopy(tok)
    tok.chat_template = ("{% if messages[0]['content'] == 'bad' %}{{ raise_exception('no bad words') }}{% endif %}"
                         "{{ messages[0]['content'] }}")
    return tok


def test_config_refuses_bad_values(tiny_llama):
    with pytest.raises(ValueError, match="either prompt_column or template"):
        BatchConfig(model=tiny_llama, prompt_column="p", template="{{ p }}")
    with pytest.raises(ValueError, match="num_replicas=0"):
        BatchConfig(model=tiny_llama, num_replicas=0)
    with pytest.raises(ValueError, match="temperature=-1"):
        BatchConfig(model=tiny_llama, temperature=-1)
    with pytest.raises(ValueError, match="json_schema needs json_schema.schema"):
        BatchConfig(model=tiny_llama, response_format={"type": "json_schema"})


def test_rows_name_their_adapter_by_the_lora_column(tiny_llama):
    config = BatchConfig(model=tiny_llama, loras=["sql=/a/sql", "chat=/a/chat"])
    assert config.lora_column == "lora" and config.llm_kwargs()["enable_lora"]
    assert row_lora(config, {"id": 0, "lora": "chat"}) == LoRARequest("chat", 2, "/a/chat")  # ids in --lora order
    assert row_lora(config, {"id": 1, "lora": None}) is None and row_lora(config, {"id": 2, "lora": ""}) is None
    with pytest.raises(ValueError, match=r"row id=3: column 'lora' names adapter 'nope', which is not among "
                                         r"--lora \['chat', 'sql'\]"):
        row_lora(config, {"id": 3, "lora": "nope"})
    with pytest.raises(ValueError, match=r"has no column\(s\) \['adapter'\]"):  # checked before any row
        check_columns(BatchConfig(model=tiny_llama, loras={"sql": "/a"}, lora_column="adapter"), ["prompt"], "in")
    with pytest.raises(ValueError, match="lora_column='lora' names adapters, but no adapter is given"):
        BatchConfig(model=tiny_llama, lora_column="lora")
    with pytest.raises(ValueError, match="--lora entry 'sql' is invalid: expected name=path"):
        BatchConfig(model=tiny_llama, loras=["sql"])
    assert not BatchConfig(model=tiny_llama).llm_kwargs().get("enable_lora")


def test_adapters_and_rows_naming_them_are_checked_before_the_job(tiny_llama, tmp_path):
    """What run_job checks up front (serve_app/batch/inputs.py): every adapter against the model, and
    each row's adapter, reported as any bad row is (its id and why)."""
    import pyarrow as pa

    from serve_app.batch.inputs import _check_batch, _check_up_front
    from tests.test_serve_lora_adapters import write_adapter_files

    write_adapter_files(tmp_path / "big", {"r": 64})
    bad = BatchConfig(model=tiny_llama, loras={"big": str(tmp_path / "big")})
    with pytest.raises(ValueError, match="--lora: adapter 'big': .* r=64 exceeds max_lora_rank=16"):
        _check_up_front(bad, ["prompt", "lora"], None, "in.jsonl")
    config = BatchConfig(model=tiny_llama, loras={"sql": "/a/sql"})
    rows = pa.Table.from_pylist([{"id": 0, "prompt": "x", "lora": "sql"}, {"id": 1, "prompt": "y", "lora": "chat"}])
    assert _check_batch(rows, config, None) == [
        None, "row id=1: column 'lora' names adapter 'chat', which is not among --lora ['sql']"]


def test_response_format_forms(tiny_llama):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    for rf in (schema, {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}):
        assert BatchConfig(model=tiny_llama, response_format=rf).structured_outputs().json == schema
    assert BatchConfig(model=tiny_llama, response_format={"type": "json_object"}).structured_outputs().json_object
    tag = {"type": "structural_tag", "format": {"type": "const_string", "value": "ok"}}
    for rf, form, value in [({"type": "regex", "regex": "[a-z]+"}, "regex", "[a-z]+"),
                            ({"type": "choice", "choice": ["yes", "no"]}, "choice", ["yes", "no"]),
                            ({"type": "grammar", "grammar": 'root ::= "a"'}, "grammar", 'root ::= "a"'),
                            (tag, "structural_tag", tag)]:
        structured = BatchConfig(model=tiny_llama, response_format=rf).structured_outputs()
        assert (structured.form, getattr(structured, form)) == (form, value)


@pytest.mark.parametrize("rf, named", [
    ({"type": "regex"}, "response_format of type regex needs a 'regex' key"),
    ({"type": "regex", "regex": "(?=a)a"}, "structured_outputs.regex is invalid: lookaround"),
    ({"type": "choice", "choice": []}, "structured_outputs.choice is invalid"),
    ({"type": "grammar", "grammar": "start ::= [a-z]"}, 'root rule with name "root" is not found'),
    ({"type": "structural_tag", "format": {"type": "nope"}}, "Format type not recognized"),
    ({"type": "object", "properties": {"a": {"type": "integer", "minimum": 3, "maximum": 1}}},
     "minimum greater than maximum"),  # xgrammar's own refusal, found without a tokenizer
])
def test_bad_response_formats_fail_at_config_time(tiny_llama, rf, named):
    with pytest.raises(ValueError, match=re.escape(named)):
        BatchConfig(model=tiny_llama, response_format=rf)


def test_row_seed_depends_on_the_id_only(tiny_llama):
    config = BatchConfig(model=tiny_llama, temperature=0.8, seed=3)
    assert config.sampling_params("a").seed == config.sampling_params("a").seed == row_seed(3, "a")
    assert row_seed(3, "a") != row_seed(3, "b") and row_seed(3, 1) != row_seed(3, "1")
    assert BatchConfig(model=tiny_llama).sampling_params(0).seed is None


def test_from_files_names_an_unreadable_file(tiny_llama, tmp_path):
    with pytest.raises(ValueError, match="cannot read the template file .*nope.j2"):
        BatchConfig.from_files(template_file=str(tmp_path / "nope.j2"), model=tiny_llama)
    bad = tmp_path / "schema.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="schema.json is not valid JSON"):
        BatchConfig.from_files(response_format_file=str(bad), model=tiny_llama)


def test_input_columns_the_output_would_overwrite_are_kept_renamed(tiny_llama):
    config = BatchConfig(model=tiny_llama, template="Doc: {{ text }}")
    row = build_prompts(config, load_tokenizer(tiny_llama), [{"id": 0, "text": "the doc", "error": 1}])[0]
    assert (row["prompt"], row["input_text"], row["input_error"]) == ("Doc: the doc", "the doc", 1)
    assert "text" not in row and "error" not in row
    same = build_prompts(BatchConfig(model=tiny_llama), load_tokenizer(tiny_llama), [{"id": 0, "prompt": "p"}])[0]
    assert "input_prompt" not in same and same["prompt"] == "p"
