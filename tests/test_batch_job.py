"""serve_app.batch end to end: real Ray (the suite's shared local cluster), tiny random models.

The SIGTERM test's job is a CLI subprocess, which starts a cluster of its own as users' jobs do."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jsonschema
import pytest
import ray
from ray import cloudpickle

from engine import LLM, SamplingParams
from serve_app.batch import BatchConfig, build_processor, run_job, shards
from serve_app.batch import processor as processor_module
from serve_app.batch.stages import EngineStage

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module", autouse=True)
def no_progress_bars(ray_cluster):
    import ray
    context = ray.data.DataContext.get_current()
    saved, context.enable_progress_bars = context.enable_progress_bars, False
    yield
    context.enable_progress_bars = saved


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _by_id(out_dir):
    rows = shards.read_rows(str(out_dir))
    assert len(rows) == len({r["id"] for r in rows}), "an id was written twice"
    return {r["id"]: r for r in rows}


PROMPTS = [f"the story of item {i} is" + " long" * (i % 5) for i in range(10)]


def test_the_benchmarks_engine_actor_path_generates_what_llm_generate_does(ray_cluster, tiny_llama):
    from loadtest.batch_bench import feed_engine

    processor = processor_module.Processor(BatchConfig(model=tiny_llama, device="cpu", max_tokens=8, batch_size=3))
    processor.start_engines()
    try:
        wall, texts, tokens = feed_engine(processor.engines[0], PROMPTS, batch_size=3, in_flight=2)
    finally:
        processor.shutdown()
    expected = LLM(tiny_llama, device="cpu").generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0),
                                                      use_tqdm=False)
    assert texts == [ref.outputs[0].text for ref in expected]  # in prompt order, whatever order batches end
    assert tokens == 8 * len(PROMPTS) and wall > 0


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_outputs_equal_llm_generate_row_for_row(ray_cluster, tiny_llama, tmp_path, fmt, no_early_stops):
    src = _write_jsonl(tmp_path / "in.jsonl", [{"prompt": p} for p in PROMPTS])
    config = BatchConfig(model=tiny_llama, device="cpu", max_tokens=8, batch_size=4)
    summary = run_job(config, src, str(tmp_path / "out"), output_format=fmt, progress=False)
    expected = LLM(tiny_llama, device="cpu").generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0),
                                                      use_tqdm=False)
    got = _by_id(tmp_path / "out")
    assert sorted(got) == list(range(len(PROMPTS)))  # ids: row positions
    for i, ref in enumerate(expected):
        row = got[i]
        assert (row["prompt"], row["text"], row["finish_reason"]) == (PROMPTS[i], ref.outputs[0].text, "length")
        assert row["num_prompt_tokens"] == len(ref.prompt_token_ids)
        assert row["num_generated_tokens"] == len(ref.outputs[0].token_ids) == 8
    assert (summary.num_rows, summary.num_generated_tokens, summary.num_invalid) == (10, 80, 0)
    assert summary.num_prompt_tokens == sum(len(r.prompt_token_ids) for r in expected)


def test_template_with_variables_and_an_id_column(ray_cluster, tiny_llama, tmp_path, no_early_stops):
    src = tmp_path / "in.csv"
    src.write_text("key,title,body\nk1,Cats,They sleep\nk2,Dogs,They bark\nk3,Owls,They hoot\n")
    template = "Title: {{ title }}\nText: {{ body }}\nSummary:"
    config = BatchConfig(model=tiny_llama, device="cpu", max_tokens=6, template=template, id_column="key")
    run_job(config, str(src), str(tmp_path / "out"), progress=False)
    rendered = {"k1": "Title: Cats\nText: They sleep\nSummary:", "k2": "Title: Dogs\nText: They bark\nSummary:",
                "k3": "Title: Owls\nText: They hoot\nSummary:"}
    expected = LLM(tiny_llama, device="cpu").generate(list(rendered.values()), SamplingParams(max_tokens=6,
                                                      temperature=0), use_tqdm=False)
    got = _by_id(tmp_path / "out")
    assert sorted(got) == ["k1", "k2", "k3"]
    for (key, prompt), ref in zip(rendered.items(), expected):
        assert (got[key]["prompt"], got[key]["text"]) == (prompt, ref.outputs[0].text)
        assert got[key]["title"] and got[key]["body"]  # the input's columns come along


def test_chat_template_equals_llm_chat(ray_cluster, tiny_qwen2, tmp_path):
    questions = ["what is a cat?", "name a colour", "count to three"]
    src = _write_jsonl(tmp_path / "in.jsonl", [{"q": q} for q in questions])
    config = BatchConfig(model=tiny_qwen2, device="cpu", max_tokens=6, prompt_column="q", chat=True)
    run_job(config, src, str(tmp_path / "out"), progress=False)
    expected = LLM(tiny_qwen2, device="cpu").chat([[{"role": "user", "content": q}] for q in questions],
                                                  SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)
    got = _by_id(tmp_path / "out")
    for i, ref in enumerate(expected):
        assert got[i]["text"] == ref.outputs[0].text
        assert got[i]["prompt"].startswith("<|im_start|>user\n" + questions[i])


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


def test_json_schema_rows_are_valid_or_flagged(ray_cluster, tiny_llama, tmp_path):
    docs = [f"extract the person from: person {i} is called Ann and is {20 + i} years old" for i in range(8)]
    src = _write_jsonl(tmp_path / "in.jsonl", [{"prompt": d} for d in docs])
    config = BatchConfig(model=tiny_llama, device="cpu", max_tokens=40, response_format=SCHEMA,
                         temperature=0.7, seed=1)
    summary = run_job(config, src, str(tmp_path / "out"), progress=False)
    rows = _by_id(tmp_path / "out").values()
    assert len(rows) == 8
    for row in rows:
        if row["valid"]:
            jsonschema.validate(json.loads(row["text"]), SCHEMA)
            assert row["error"] is None
        else:  # flagged with the guardrail's reason, never dropped
            assert row["error"].split(":")[0] in ("invalid_json", "schema")
            with pytest.raises((ValueError, jsonschema.ValidationError)):
                jsonschema.validate(json.loads(row["text"]), SCHEMA)
    assert summary.num_invalid == sum(not r["valid"] for r in rows)


def test_position_ids_number_the_rows_in_input_order(ray_cluster, tmp_path, no_early_stops):
    import ray

    from serve_app.batch import with_position_ids
    src = _write_jsonl(tmp_path / "in.jsonl", [{"prompt": f"p{i}"} for i in range(7)])
    rows = with_position_ids(ray.data.read_json(src, lines=True)).take_all()
    assert [(r["id"], r["prompt"]) for r in rows] == [(i, f"p{i}") for i in range(7)]
    with pytest.raises(ValueError, match="has an 'id' column: name it as the id column"):
        with_position_ids(ray.data.from_items([{"id": 1}]))


def test_continue_on_error_writes_the_refused_row_and_finishes_the_job(ray_cluster, tiny_llama, tmp_path):
    prompts = ["a fine prompt", "word " * 3000, "another fine one", "and a last"]  # [1]: over 2048 positions
    src = _write_jsonl(tmp_path / "in.jsonl", [{"prompt": p} for p in prompts])
    config = BatchConfig(model=tiny_llama, device="cpu", max_tokens=4, batch_size=2, continue_on_error=True)
    summary = run_job(config, src, str(tmp_path / "out"), output_format="parquet", progress=False)
    rows = _by_id(tmp_path / "out")  # Parquet shards with and without a failed row read as one schema
    assert sorted(rows) == [0, 1, 2, 3] and (summary.num_rows, summary.num_failed) == (4, 1)
    assert (rows[1]["text"], rows[1]["finish_reason"]) == (None, "error") and "row id=1" in rows[1]["error"]
    assert all(rows[i]["error"] is None and rows[i]["num_generated_tokens"] == 4 for i in (0, 2, 3))
    assert summary.num_generated_tokens == 12 and "1 failed rows" in str(summary)


def test_processor_api_with_preprocess_and_postprocess(ray_cluster, tiny_llama, tmp_path, no_early_stops):
    import ray
    # A lazy read, its schema unknown: the ids are taken from the `key` column batch by batch.
    ds = ray.data.read_json(_write_jsonl(tmp_path / "in.jsonl", [{"key": i, "n": i} for i in range(4)]), lines=True)
    processor = build_processor(BatchConfig(model=tiny_llama, device="cpu", max_tokens=4, template="number {{ word }}",
                                            id_column="key"),
                                preprocess=lambda row: {**row, "word": "x" * (row["n"] + 1)},
                                postprocess=lambda row: {"short": row["text"][:3], "n_plus": row["n"] + 1})
    try:
        rows = sorted(processor(ds).take_all(), key=lambda r: r["id"])
        assert processor.num_retries == 0
    finally:
        processor.shutdown()  # its engine actor holds a CPU of the shared cluster until then
    assert [r["prompt"] for r in rows] == ["number x", "number xx", "number xxx", "number xxxx"]
    assert all(r["short"] == r["text"][:3] and r["n_plus"] == r["n"] + 1 for r in rows)


class _DiesOnce(EngineStage):
    """An engine actor whose process dies (as an OOM-kill would) in its first batch, once per `marker`."""
    marker = ""

    async def _generate(self, *args):
        if not os.path.exists(self.marker):
            Path(self.marker).touch()
            os._exit(1)
        return await super()._generate(*args)


def test_a_batch_whose_actor_dies_is_rerun_and_counted_not_the_job(ray_cluster, tiny_llama, tmp_path, monkeypatch):
    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the actor class travels by value
    _DiesOnce.marker = str(tmp_path / "died")
    monkeypatch.setattr(processor_module, "EngineStage", _DiesOnce)
    src = _write_jsonl(tmp_path / "in.jsonl", [{"prompt": p} for p in PROMPTS])
    config = BatchConfig(model=tiny_llama, device="cpu", max_tokens=8, batch_size=4)
    summary = run_job(config, src, str(tmp_path / "out"), progress=False)
    assert os.path.exists(_DiesOnce.marker)
    assert summary.num_actor_restarts == 1
    assert 1 <= summary.num_retries <= 3  # the batches that had started in the dead actor
    expected = LLM(tiny_llama, device="cpu").generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0),
                                                      use_tqdm=False)
    got = _by_id(tmp_path / "out")  # every id once
    assert [got[i]["text"] for i in range(len(PROMPTS))] == [e.outputs[0].text for e in expected]


@pytest.fixture
def no_early_stops(monkeypatch):
    """Reading and checking the input run no Dataset execution that stops early: Ray Data's schema
    probe is one (limit(1)), and it force-kills the read tasks still running, which can crash Ray
    2.60's core worker when one is just finishing (task_manager.cc, "not pending")."""
    import ray

    def limit(self, n):
        raise AssertionError(f"Dataset.limit({n}): an execution that stops early")
    monkeypatch.setattr(ray.data.Dataset, "limit", limit)


def test_bad_input_fails_fast_naming_it(ray_cluster, tiny_llama, tmp_path, no_early_stops):
    free_before = _free_cpus()
    config = BatchConfig(model=tiny_llama, device="cpu", max_tokens=4, template="{{ title }}: {{ body }}")
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=r"cannot read the input .*nope.jsonl"):
        run_job(config, str(tmp_path / "nope.jsonl"), str(out), progress=False)
    src = _write_jsonl(tmp_path / "a.jsonl", [{"title": "t"}])
    with pytest.raises(ValueError, match=r"has no column\(s\) \['body'\]"):
        run_job(config, src, str(out), progress=False)
    src = _write_jsonl(tmp_path / "b.jsonl", [{"title": "t", "body": "b"}, {"title": "u", "body": None}])
    with pytest.raises(ValueError, match=r"row id=1: template variable\(s\) \['body'\] absent"):
        run_job(config, src, str(out), progress=False)
    src = _write_jsonl(tmp_path / "c.jsonl", [{"k": 1, "title": "t", "body": "b"}] * 2)
    with pytest.raises(ValueError, match="id 1 appears more than once"):
        run_job(BatchConfig(model=tiny_llama, template="{{ title }}", id_column="k"), src, str(out), progress=False)
    with pytest.raises(ValueError, match=r"has no column\(s\) \['doc'\]"):
        run_job(BatchConfig(model=tiny_llama, template="{{ title }}", id_column="doc"), src, str(out), progress=False)
    src = _write_jsonl(tmp_path / "d.jsonl", [{"k": 1, "title": "t"}, {"k": None, "title": "u"}])
    with pytest.raises(ValueError, match=r"d.jsonl: a row has no id \(null\)"):
        run_job(BatchConfig(model=tiny_llama, template="{{ title }}", id_column="k"), src, str(out), progress=False)
    (tmp_path / "e.jsonl").write_text('{"title": "t", "body": "b"}\n{"title": \n')
    with pytest.raises(ValueError, match=r"cannot read the input .*e.jsonl"):
        run_job(config, str(tmp_path / "e.jsonl"), str(out), progress=False)
    assert not out.exists()  # nothing generated
    _assert_engines_stopped(free_before)
    shards.write_shard(str(out), __import__("pyarrow").table({"id": [0]}), "jsonl")
    with pytest.raises(ValueError, match="holds 1 shard.*--resume"):
        run_job(config, src, str(out), progress=False)


def _free_cpus() -> float:
    import ray
    return ray.available_resources().get("CPU", 0)


def _assert_engines_stopped(free_before: float):
    """The engine actors the jobs started (while they checked their input) hold no CPU after they ended:
    the CPUs free before them are free again."""
    deadline = time.monotonic() + 60  # a killed actor's CPU comes back once its worker is gone: slow on a busy box
    while _free_cpus() < free_before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _free_cpus() >= free_before, _cpu_holders()


def _cpu_holders() -> str:
    """What holds the cluster's CPUs now (for a failure message): alive actors and running tasks."""
    try:
        from ray.util import state

        actors = [(a.class_name, a.state) for a in state.list_actors(filters=[("state", "!=", "DEAD")])]
        tasks = [(t.name, t.state) for t in state.list_tasks(filters=[("state", "=", "RUNNING")])]
        return f"CPUs free {_free_cpus()}; actors {actors}; running tasks {tasks}"
    except Exception as e:  # noqa: BLE001 - the state API is best effort here; the failure stands
        return f"CPUs free {_free_cpus()}; the state API failed: {e!r}"


def _cli(model, src, out, *extra, own_cluster=True):
    """The batch CLI in a process of its own: on a new local cluster (own_cluster, as a user runs it on
    one machine), or on the suite's cluster through RAY_ADDRESS (as a RayJob runs it)."""
    cmd = [sys.executable, "-m", "serve_app.batch", "--model", model, "--input", src, "--output", out,
           "--device", "cpu", "--max-tokens", "12", "--batch-size", "2", "--temperature", "0.8", "--seed", "7",
           "--no-progress", *extra]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    env.pop("RAY_ADDRESS", None)
    if not own_cluster:
        cmd += ["--address", ray.get_runtime_context().gcs_address]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_sigterm_midway_then_resume_gives_every_id_once_with_the_same_outputs(ray_cluster, tiny_llama, tmp_path):
    n = 40
    src = _write_jsonl(tmp_path / "in.jsonl", [{"prompt": f"row {i} says" + " more" * (i % 7)} for i in range(n)])
    out = tmp_path / "out"
    job = _cli(tiny_llama, src, str(out))
    deadline = time.monotonic() + 240
    while not shards.list_shards(str(out)) and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)  # signalled at the first shard: the other 19 batches are still to come
    job.send_signal(signal.SIGTERM)
    log = job.communicate(timeout=120)[0]
    assert job.returncode == 143, log
    partial = _by_id(out)
    assert 0 < len(partial) < n, "the job was not killed midway"
    resumed = _cli(tiny_llama, src, str(out), "--resume", own_cluster=False)
    log = resumed.communicate(timeout=300)[0]
    assert resumed.returncode == 0, log
    assert f"({len(partial)} already done)" in log
    got = _by_id(out)
    assert sorted(got) == list(range(n))
    # The same outputs as one uninterrupted run: seeds follow the row's id, not its batch, so each row is
    # what LLM.generate gives it with that row's sampling params (row for row: test_outputs_equal_llm_...).
    config = BatchConfig(model=tiny_llama, device="cpu", max_tokens=12, temperature=0.8, seed=7)
    prompts = [json.loads(line)["prompt"] for line in Path(src).read_text().splitlines()]
    ref = LLM(tiny_llama, device="cpu").generate(prompts, [config.sampling_params(i) for i in range(n)],
                                                 use_tqdm=False)
    assert {i: got[i]["text"] for i in got} == {i: r.outputs[0].text for i, r in enumerate(ref)}
    assert all(got[i]["text"] == partial[i]["text"] for i in partial)
