"""serve_app.batch.stages without Ray: concurrent batches in one engine, the engine stage's retry, the JSON checks, user functions."""
import asyncio
import types

import pyarrow as pa
import pytest

from engine import LLM, SamplingParams
from engine.entrypoints.async_llm import EngineDeadError
from engine.errors import PromptTooLongError
from serve_app.batch.config import BatchConfig
from serve_app.batch.stages import EngineStage, RetryCounter, ids_from_column, postprocess_batch, preprocess_batch
from tests.faults import fail_next_step

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def _rows(config, prompts):
    return preprocess_batch(pa.Table.from_pylist([{"id": i, "prompt": p} for i, p in enumerate(prompts)]),
                            config, None)


class _Counter(RetryCounter):
    """Stands in for the RetryCounter actor's handle: counter.<method>.remote(...) calls it here."""

    def __getattribute__(self, name):
        method = super().__getattribute__(name)
        if name in ("add", "batch_started", "actor_restarted"):
            return types.SimpleNamespace(remote=lambda *args: _Done(method(*args)))
        return method


class _Done:
    def __init__(self, value):
        self.value = value

    def __await__(self):
        return self.value
        yield


def _generate_all(stage, batches):
    """Several batches in one actor at once, as Ray Data runs them (one event loop, concurrent calls)."""
    async def run():
        return await asyncio.gather(*(stage(b) for b in batches))
    return [t.to_pylist() for t in asyncio.run(run())]


def test_concurrent_batches_in_one_engine_equal_llm_generate_row_for_row(tiny_llama):
    prompts = [f"row {i} is about" + " more" * (i % 4) for i in range(12)]
    for temperature, seed in ((0.0, None), (0.9, 3)):  # greedy, and seeded sampling (a seed per row id)
        config = BatchConfig(model=tiny_llama, max_tokens=7, temperature=temperature, seed=seed)
        rows = _rows(config, prompts)
        got = _generate_all(EngineStage(config), [rows.slice(0, 5), rows.slice(5, 4), rows.slice(9)])
        got = [r for batch in got for r in batch]
        expected = LLM(tiny_llama).generate(prompts, [config.sampling_params(i) for i in range(12)],
                                            use_tqdm=False)
        assert [r["id"] for r in got] == list(range(12))
        assert [r["text"] for r in got] == [e.outputs[0].text for e in expected]
        assert [r["num_generated_tokens"] for r in got] == [len(e.outputs[0].token_ids) for e in expected]


def test_each_row_runs_the_adapter_its_lora_column_names(tiny_llama, tiny_llama_loras):
    """`--lora a=... --lora b=...` and a per-row column (null or empty: the base model): each row's text
    is HF's greedy on the base model with its adapter merged, rows of both adapters in one engine."""
    from transformers import AutoTokenizer

    from tests.hf_reference import hf_greedy
    from tests.test_serve_lora import expected_text

    names = ["a", None, "b", "a", "", "b"]
    prompts = [f"row {i} is about" + " more" * (i % 3) for i in range(len(names))]
    config = BatchConfig(model=tiny_llama, max_tokens=6, loras=[f"{n}={tiny_llama_loras.paths[n]}" for n in "ab"],
                         lora_column="adapter", engine_kwargs={"max_loras": 2})
    table = pa.Table.from_pylist([{"id": i, "prompt": p, "adapter": n} for i, (p, n) in enumerate(zip(prompts, names))])
    got = [r for batch in _generate_all(EngineStage(config), [preprocess_batch(table, config, None)]) for r in batch]
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    for row, prompt, name in zip(got, prompts, names):
        prompt_ids = tok(prompt)["input_ids"]
        ids = hf_greedy(tiny_llama_loras.merged[name] if name else tiny_llama, prompt_ids, 6).token_ids
        if tok.eos_token_id in ids:  # the engine stops there; the oracle's loop does not
            ids = ids[:ids.index(tok.eos_token_id) + 1]
        assert (row["text"], row["adapter"]) == (expected_text(tok, prompt_ids, ids), name), row["id"]


def test_batches_failing_together_are_retried_on_one_fresh_engine(tiny_llama):
    config = BatchConfig(model=tiny_llama, max_tokens=30, max_batch_retries=1)  # device auto: no thread changes
    counter = _Counter()
    stage = EngineStage(config, retry_counter=counter)
    first, engines = stage.llm, []
    new_llm = stage._new_llm
    stage._new_llm = lambda: engines.append(new_llm()) or engines[-1]
    prompts = ["one two", "three", "four five six", "seven"]
    rows = _rows(config, prompts)

    async def run():
        calls = [asyncio.ensure_future(stage(rows.slice(0, 2))), asyncio.ensure_future(stage(rows.slice(2)))]
        while not first.engine.has_unfinished_requests():  # both batches are in the engine: kill it mid-way
            await asyncio.sleep(0.001)
        await fail_next_step(first, RuntimeError("injected: CUDA error"))
        return await asyncio.gather(*calls)

    out = [r for t in asyncio.run(run()) for r in t.to_pylist()]
    assert engines == [stage.llm] and not first.is_running  # one replacement for both batches
    assert counter.count == 2  # each batch counted once
    expected = LLM(tiny_llama).generate(prompts, SamplingParams(max_tokens=30, temperature=0), use_tqdm=False)
    assert [r["text"] for r in out] == [e.outputs[0].text for e in expected]
    assert "prompt_token_ids" not in out[0] and out[0]["num_generated_tokens"] == len(expected[0].outputs[0].token_ids)


def test_a_stage_with_a_retry_counter_builds_in_a_driver_that_runs_ray(ray_cluster, tiny_llama):
    """Ray started in this process (a driver, not an actor): asking whether the actor was restarted
    must answer "no", not fail the stage's constructor."""
    stage = EngineStage(BatchConfig(model=tiny_llama, max_tokens=2), retry_counter=_Counter())
    try:
        assert stage.llm.is_running
    finally:
        stage.llm.shutdown()


def test_a_batch_failing_every_attempt_fails(tiny_llama):
    stage = EngineStage(BatchConfig(model=tiny_llama, max_tokens=2, max_batch_retries=0))
    asyncio.run(fail_next_step(stage.llm, RuntimeError("boom")))
    with pytest.raises(EngineDeadError, match="boom"):
        asyncio.run(stage(_rows(stage.config, ["x"])))


def test_a_row_the_engine_refuses_fails_its_batch_at_once_naming_it(tiny_llama):
    counter = _Counter()
    stage = EngineStage(BatchConfig(model=tiny_llama, max_tokens=4, max_batch_retries=2), retry_counter=counter)
    engine = stage.llm
    rows = _rows(stage.config, ["fine", "word " * 3000])  # longer than the model's 2048 positions
    with pytest.raises(PromptTooLongError, match="row id=1: "):
        asyncio.run(stage(rows))
    assert stage.llm is engine and engine.is_running and counter.count == 0  # no engine would take it


def test_continue_on_error_keeps_a_refused_row_with_its_error_and_generates_the_rest(tiny_llama):
    stage = EngineStage(BatchConfig(model=tiny_llama, max_tokens=4, continue_on_error=True,
                                    response_format={"type": "json_object"}))
    prompts = ["fine", "word " * 3000, "also fine"]  # the second is longer than the model's 2048 positions
    out = asyncio.run(stage(_rows(stage.config, prompts))).to_pylist()
    expected = LLM(tiny_llama).generate([prompts[0], prompts[2]], stage.config.sampling_params(0), use_tqdm=False)
    assert [out[0]["text"], out[2]["text"]] == [e.outputs[0].text for e in expected]
    assert out[0]["error"] is None and out[0]["num_generated_tokens"] == len(expected[0].outputs[0].token_ids)
    refused = out[1]
    assert (refused["id"], refused["text"], refused["finish_reason"]) == (1, None, "error")
    assert refused["num_prompt_tokens"] is None and refused["num_generated_tokens"] is None
    assert refused["error"].startswith("row id=1: ") and "2048" in refused["error"]
    checked = postprocess_batch(pa.Table.from_pylist(out), stage.config, None).to_pylist()
    assert checked[1]["valid"] is False and checked[1]["error"] == refused["error"]  # its reason is kept
    with pytest.raises(ValueError, match="continue_on_error='yes' is invalid"):
        BatchConfig(model=tiny_llama, continue_on_error="yes")


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


@pytest.mark.parametrize("rf, rows, valid", [
    ({"type": "regex", "regex": r"\d{2}"}, [("42", "stop"), ("4", "length"), ("4x", "stop")], [True, False, False]),
    ({"type": "choice", "choice": ["yes", "no"]}, [("no", "stop"), ("n", "length"), ("nope", "stop")],
     [True, False, False]),
    ({"type": "grammar", "grammar": 'root ::= "a"+'}, [("aa", "stop"), ("aaa", "length")], [True, False]),
])
def test_other_forms_are_checked_too(tiny_llama, rf, rows, valid):
    config = BatchConfig(model=tiny_llama, response_format=rf)
    batch = pa.Table.from_pylist([{"id": i, "text": t, "finish_reason": f} for i, (t, f) in enumerate(rows)])
    out = postprocess_batch(batch, config, None).to_pylist()
    assert [r["valid"] for r in out] == valid
    assert all((r["error"] is None) == r["valid"] for r in out)
    assert all("max_tokens cut it off" in r["error"] for r, (_, f) in zip(out, rows) if f == "length")


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


def test_ids_come_from_the_id_column_or_a_clear_error():
    table = pa.table({"key": ["a", "b"], "id": [7, 8], "prompt": ["x", "y"]})
    renamed = ids_from_column(table, "key")
    assert (renamed.column_names, renamed.column("id").to_pylist()) == (["id", "prompt"], ["a", "b"])
    assert ids_from_column(table, "id").column("id").to_pylist() == [7, 8]
    assert ids_from_column(table, None) is table
    with pytest.raises(ValueError, match=r"no id column 'doc' \(its columns: \['id', 'key', 'prompt'\]\)"):
        ids_from_column(table, "doc")
    with pytest.raises(ValueError, match="has no 'id' column: set id_column="):
        ids_from_column(table.drop_columns(["id"]), None)
