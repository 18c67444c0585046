"""serve_app.batch.stages without Ray: the engine stage's retry, the JSON checks, user functions."""
import pyarrow as pa
import pytest

from engine import LLM, SamplingParams
from serve_app.batch.config import BatchConfig
from serve_app.batch.stages import EngineStage, postprocess_batch, preprocess_batch

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def _rows(config, prompts):
    return preprocess_batch(pa.Table.from_pylist([{"id": i, "prompt": p} for i, p in enumerate(prompts)]),
                            config, None)


def test_a_failed_batch_is_retried_on_a_fresh_engine(tiny_llama):
    config = BatchConfig(model=tiny_llama, max_tokens=5, max_batch_retries=1)  # device auto: no thread changes
    stage = EngineStage(config)
    first = stage.llm
    calls = []

    def fail_once(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("injected: CUDA error")

    first.generate = fail_once
    out = stage(_rows(config, ["one two", "three"])).to_pylist()
    assert calls == [1] and stage.llm is not first
    expected = LLM(tiny_llama).generate(["one two", "three"], SamplingParams(max_tokens=5, temperature=0),
                                        use_tqdm=False)
    assert [r["text"] for r in out] == [e.outputs[0].text for e in expected]
    assert "prompt_token_ids" not in out[0] and out[0]["num_generated_tokens"] == 5


def test_a_batch_failing_every_attempt_fails(tiny_llama):
    stage = EngineStage(BatchConfig(model=tiny_llama, max_tokens=2, max_batch_retries=0))
    stage.llm.generate = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom"))
    with pytest.raises(RuntimeError, match="boom"):
        stage(_rows(stage.config, ["x"]))


def test_json_rows_are_flagged_not_dropped(tiny_llama):
    config = BatchConfig(model=tiny_llama, response_format=SCHEMA)
    batch = pa.Table.from_pylist([
        {"id": 0, "text": '{"a": 1}', "finish_reason": "stop"},
        {"id": 1, "text": '{"a": "x"}', "finish_reason": "stop"},
        {"id": 2, "text": '{"a": 1', "finish_reason": "length"}])
    rows = postprocess_batch(batch, config, None).to_pylist()
    assert [r["valid"] for r in rows] == [True, False, False]
    assert rows[0]["error"] is None
    assert rows[1]["error"].startswith("schema: ") and "'x' is not of type 'integer'" in rows[1]["error"]
    assert rows[2]["error"].startswith("invalid_json: ") and "max_tokens cut it off" in rows[2]["error"]


def test_user_functions_see_and_extend_the_row(tiny_llama):
    config = BatchConfig(model=tiny_llama, template="{{ a }} and {{ b }}")
    pre = preprocess_batch(pa.Table.from_pylist([{"id": 0, "a": "x"}]), config, lambda r: {**r, "b": "y"})
    assert pre.to_pylist()[0]["prompt"] == "x and y"
    post = postprocess_batch(pa.Table.from_pylist([{"id": 0, "text": "hi", "finish_reason": "stop"}]), config,
                             lambda r: {"loud": r["text"].upper()})
    assert post.to_pylist() == [{"id": 0, "text": "hi", "finish_reason": "stop", "loud": "HI"}]
    with pytest.raises(TypeError, match="postprocess function must return a dict"):
        postprocess_batch(pa.Table.from_pylist([{"id": 0, "text": "hi", "finish_reason": "stop"}]), config,
                          lambda r: None)
