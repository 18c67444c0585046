"""LoRA adapters served as models (docs/lora.md, "Serving") on the suite's shared Ray cluster: two
engine replicas, adapters routed by Serve's model multiplexing, loaded and unloaded at run time.

Greedy answers are checked against HF transformers on the base model with each adapter merged
(tests/conftest.py's tiny_llama_loras); the adapter loads each replica counts in /metrics show
where the adapters went, and that repeat requests went back there.
"""
import json
import os
import re
import shutil
from pathlib import Path

import httpx
import pytest
from ray import serve
from transformers import AutoTokenizer

from engine.core.detokenizer import IncrementalDetokenizer
from engine.sampling_params import SamplingParams
from serve_app.local import deployed_app
from tests.hf_reference import NEAR_TIE, hf_greedy
from tests.test_serve import _app_metrics, _metric, _wait_metric

pytestmark = pytest.mark.timeout(600)

APP = "test_serve_lora"
MODEL = "tiny-llama"
API_KEY = "sk-lora"
MAX_TOKENS = 6
PROMPTS = [[17, 431, 88, 902, 5, 260, 77, 318], [640, 12, 99, 480, 301, 8, 555]]
STATIC = ("a", "b", "c")  # lora_modules; "d" is loaded at run time
LOADS = "ray_rayllm_lora_adapter_loads_total"


def expected_text(tokenizer, prompt_ids: list[int], token_ids: list[int]) -> str:
    """The text the engine sends for these tokens: its own detokenizer, a token a step (a byte-level
    BPE token may end inside a character, which a plain decode would show as U+FFFD)."""
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, SamplingParams())
    for token_id in token_ids:
        detokenizer.update([token_id])
    return detokenizer.get_next_output_text(finished=True, delta=False)


@pytest.fixture(scope="module")
def reference(tiny_llama, tiny_llama_loras):
    """model -> the greedy text of each prompt: HF on the base model, or with that adapter merged."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    refs = {}
    for model, path in {MODEL: tiny_llama, **tiny_llama_loras.merged}.items():
        outs = [hf_greedy(path, prompt, MAX_TOKENS) for prompt in PROMPTS]
        assert all(min(o.gaps) >= NEAR_TIE for o in outs), "a near tie: the oracle could go either way"
        refs[model] = [expected_text(tokenizer, p, o.token_ids) for p, o in zip(PROMPTS, outs)]
    assert len({tuple(texts) for texts in refs.values()}) == len(refs), "an adapter changes nothing"
    return refs


@pytest.fixture(scope="module")
def http(ray_cluster, tiny_llama, tiny_llama_loras, reference):
    args = dict(model=tiny_llama, served_model_name=MODEL, api_key=API_KEY, device="cpu", dtype="float32",
                max_model_len=256, num_kv_blocks=64, max_num_seqs=8, seed=0, engine_process=False,
                min_replicas=2, max_replicas=2,
                lora_modules={name: tiny_llama_loras.paths[name] for name in STATIC},
                # Two adapters per step; three kept per replica: four adapters fit on two replicas with room.
                max_loras=2, max_cpu_loras=3,
                allow_runtime_lora_updating=True, lora_adapter_dir=tiny_llama_loras.root)
    with deployed_app(ray_cluster, args, APP) as url, \
            httpx.Client(base_url=url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as client:
        yield client


def _complete(http, model: str, **extra) -> httpx.Response:
    return http.post("/v1/completions", json={"model": model, "prompt": PROMPTS, "max_tokens": MAX_TOKENS,
                                              "temperature": 0, "ignore_eos": True, **extra})


def _answer(http, model: str) -> list[str]:
    r = _complete(http, model)
    assert r.status_code == 200, r.text
    return [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]


def _loads(http) -> dict[tuple[str, str], float]:
    """(replica, adapter) -> its loads so far, from /metrics."""
    loads = {}
    for line in _app_metrics(http):
        if line.startswith(LOADS + "{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line.rpartition(" ")[0]))
            loads[(labels["replica"], labels["lora_name"])] = float(line.rpartition(" ")[2])
    return loads


def _wait_exported(http, num_engine_requests: int) -> None:
    """Until /metrics holds every engine request sent so far as finished: the loads counted before
    them are exported by then too (a replica exports all of its series at once)."""
    _wait_metric(http, "ray_rayllm_request_success_total", lambda v: v >= num_engine_requests)


def test_each_adapter_answers_as_merged_and_repeats_go_where_it_was_loaded(http, reference, tiny_llama_loras):
    states = serve.status().applications[APP].deployments["EngineDeployment"].replica_states
    assert states.get("RUNNING") == 2
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "d", "lora_path": "d"})  # relative: lora_adapter_dir
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'd' added successfully.")
    sent = 0
    for name in ("a", "b", "c", "d"):  # each adapter's first request: it is loaded where it goes
        assert _answer(http, name) == reference[name], name
        sent += len(PROMPTS)
        # Its routing info has reached the callers' routers before the next adapter is placed.
        _wait_metric(http, LOADS, lambda v: v >= 1, lora_name=name)
    _wait_exported(http, sent)
    placed = _loads(http)
    for _ in range(2):  # repeats, mixed with the base model
        for name in ("a", "b", "c", "d", MODEL):
            assert _answer(http, name) == reference[name], name
            sent += len(PROMPTS)
    _wait_exported(http, sent)
    assert _loads(http) == placed  # every repeat went to a replica holding its adapter: no load storm
    assert sorted(name for _, name in placed) == ["a", "b", "c", "d"] and set(placed.values()) == {1.0}
    assert len({replica for replica, _ in placed}) == 2  # spread over both replicas


def test_models_list_the_base_and_every_adapter(http, tiny_llama, tiny_llama_loras):
    cards = {c["id"]: c for c in http.get("/v1/models").json()["data"]}
    assert list(cards) == [MODEL, "a", "b", "c", "d"]
    assert (cards[MODEL]["parent"], cards[MODEL]["root"]) == (None, tiny_llama)
    assert all(cards[n]["parent"] == MODEL and os.path.samefile(cards[n]["root"], tiny_llama_loras.paths[n])
               for n in "abcd")
    assert http.get("/v1/models/b").json() == cards["b"]


def test_unknown_models_and_bad_loads_are_refused_with_vllms_errors(http, tiny_llama_loras, tmp_path):
    r = _complete(http, "nope")
    assert r.status_code == 404 and r.json()["error"] == {
        "message": "The model `nope` does not exist.", "type": "NotFoundError", "param": "model", "code": 404}
    broken = Path(tiny_llama_loras.root) / "broken"  # inside the allowed directory, without its config
    shutil.copytree(tiny_llama_loras.paths["a"], broken)
    (broken / "adapter_config.json").unlink()
    (tmp_path / "outside").mkdir()
    try:
        cases = [({"lora_name": "x", "lora_path": "broken"}, 400, "adapter_config.json"),
                 ({"lora_name": "x", "lora_path": str(tmp_path / "outside")}, 400, "outside the directory"),
                 ({"lora_name": "x", "lora_path": "../outside"}, 400, "outside the directory"),
                 ({"lora_name": "a", "lora_path": "a"}, 400, "The lora adapter 'a' has already been loaded.")]
        for body, status, message in cases:
            r = http.post("/v1/load_lora_adapter", json=body)
            assert r.status_code == status and message in r.json()["error"]["message"], (body, r.text)
    finally:
        shutil.rmtree(broken)
    r = http.post("/v1/unload_lora_adapter", json={"lora_name": "nope"})
    assert r.status_code == 404 and r.json()["error"]["message"] == "The lora adapter 'nope' cannot be found."
    assert http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "a"},
                     headers={"Authorization": "Bearer wrong"}).status_code == 401


def test_unload_lets_running_requests_finish_and_a_reload_serves_again(http, reference):
    loads_before = _metric(http, LOADS, lora_name="d")
    with http.stream("POST", "/v1/completions", json={"model": "d", "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS,
                                                       "temperature": 0, "ignore_eos": True, "stream": True}) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))  # the request is running
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "d"}).status_code == 200
        chunks = [first] + [line for line in lines if line.startswith("data: ")]
    assert chunks[-1] == "data: [DONE]"
    events = [json.loads(c.removeprefix("data: ")) for c in chunks[:-1]]
    text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
    assert text == reference["d"][0]
    assert _complete(http, "d").status_code == 404
    assert "d" not in [c["id"] for c in http.get("/v1/models").json()["data"]]
    assert http.post("/v1/load_lora_adapter", json={"lora_name": "d", "lora_path": "d"}).status_code == 200
    assert _answer(http, "d") == reference["d"]
    # Under a new id: a new adapter to every replica's cache, loaded again where it goes.
    _wait_metric(http, LOADS, lambda v: v >= loads_before + 1, lora_name="d")
