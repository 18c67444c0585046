"""PrefixAffinityRouter in the app: two engine replicas on the shared Ray cluster serving a multi-turn
workload (three chats of three turns sharing a system prompt), every answer the engine's, every
turn on the replica holding its history, the decisions in /metrics. The policy alone:
tests/test_serve_prefix_policy.py."""
import asyncio

import httpx
import pytest
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata
from ray.serve.request_router import PendingRequest, ReplicaID

from engine.sampling_params import SamplingParams
from serve_app.http.messages import EngineRequest
from serve_app.local import deployed_app
from serve_app.replica import prefix_routing
from serve_app.replica.routing import RouterMetrics
from tests.fake_metrics import Recorder

BS = 16  # the engine's default block_size
MODEL = "tiny-llama"
ENGINE = dict(device="cpu", dtype="float32", max_model_len=256, num_kv_blocks=128, max_num_seqs=8, seed=0)
SHARED = list(range(40, 40 + 3 * BS))  # a system prompt of 3 blocks
TURN_LEN, MAX_TOKENS = 20, 4           # a user message adds a block of the conversation's own


DEPLOYMENT = DeploymentID(name="EngineDeployment", app_name="t")


class FakeReplica:
    """What the router reads of a running replica."""

    def __init__(self, name: str):
        self.replica_id = ReplicaID(unique_id=name, deployment_id=DEPLOYMENT)
        self.max_ongoing_requests = 16
        self.multiplexed_model_ids: set = set()

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return 0


def _pending(ids: list[int], batch: str = "") -> PendingRequest:
    request = EngineRequest(f"r{id(ids)}", ids, SamplingParams(), batch_id=batch or None)
    return PendingRequest(args=[request], kwargs={}, metadata=RequestMetadata(
        request_id="x", internal_request_id=f"i{id(request)}", call_method="generate", session_id=batch))


def _own(c: int) -> list[int]:
    return [100 + 240 * c + k for k in range(TURN_LEN)]


@pytest.fixture
def router(monkeypatch):
    """The router as Serve makes it in a caller, with two replicas whose queues are empty; its
    metrics recorded in memory."""
    recorder = Recorder()
    monkeypatch.setattr(prefix_routing, "RouterMetrics",
                        lambda prefix, model, target: RouterMetrics(prefix, model, target, factory=recorder))
    r = prefix_routing.PrefixAffinityRouter(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN,
                                            use_replica_queue_len_cache=True)
    r.initialize_state(block_size=BS, prefix_imbalance_bound=1, model_name="m")
    r.recorder = recorder
    return r


def test_a_burst_counts_its_own_decisions_and_the_tables_learn_where_requests_went(router):
    async def pick(replicas, pr):
        return (await router.choose_replicas(replicas, pr))[0][0].replica_id

    async def run():
        replicas = [FakeReplica("r0"), FakeReplica("r1")]
        router.update_replicas(replicas)
        for r in replicas:
            router.replica_queue_len_cache.update(r.replica_id, 0)
        burst = [_pending(SHARED + _own(c), batch="b1") for c in range(4)]  # one micro-batch, none sent yet
        picks = [await pick(replicas, pr) for pr in burst]
        x, y = picks[0], next(r.replica_id for r in replicas if r.replica_id != picks[0])
        # Bound 1: batch-mates follow their batch's replica until it is 2 ahead of the other.
        assert picks == [x, x, y, x]
        for pr, replica_id in zip(burst, [x, y, y, x]):  # the second went elsewhere (Serve's FIFO, say)
            router.on_request_routed(pr, replica_id, None)
        next_turn = _pending(SHARED + _own(1) + [7] * BS)  # its history is where it went, not where it was meant
        assert await pick(replicas, next_turn) == y
        router.update_replicas([r for r in replicas if r.replica_id == x])  # y is gone, and its table
        assert list(router._policy.tables) == [x]
        return x, await pick([r for r in replicas if r.replica_id == x], next_turn)

    x, last = asyncio.run(run())
    assert last == x
    count = lambda decision, reason: router.recorder.value("rayllm_router_requests", decision=decision,  # noqa: E731
                                                           reason=reason, target="EngineDeployment")
    assert (count("fallback", "below_threshold"), count("fallback", "other_replica"), count("fallback", "imbalanced"),
            count("affinity", "batch")) == (1, 1, 1, 1)


@pytest.fixture(scope="module")
def fleet_url(ray_cluster, tiny_llama):
    # The step loop in the replica's thread (engine_process=False): routing is the same, and two
    # replicas start without two more processes importing torch.
    args = dict(model=tiny_llama, served_model_name=MODEL, min_replicas=2, max_replicas=2, engine_cpu_threads=1,
                engine_process=False, request_router="prefix_affinity", **ENGINE)
    with deployed_app(ray_cluster, args, "test_serve_prefix_routing") as url:
        yield url


async def _conversation(http: httpx.AsyncClient, tokenizer, c: int, user: str | None) -> list[dict]:
    """Three turns, each sent after the previous answer, which joins the history as token ids."""
    prompt, turns = list(SHARED), []
    for t in range(3):
        prompt = prompt + [100 + 240 * c + 60 * t + k for k in range(TURN_LEN)]  # ids < the tiny vocab's 1000
        body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0}
        r = await http.post("/v1/completions", json=body | ({"user": user} if user else {}))
        assert r.status_code == 200, r.text
        out = r.json()
        turns.append({"prompt": list(prompt), "text": out["choices"][0]["text"],
                      "cached": (out["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)})
        prompt = prompt + tokenizer(turns[-1]["text"], add_special_tokens=False)["input_ids"]
    return turns


def test_multi_turn_answers_equal_the_engines_and_each_turn_finds_its_history(fleet_url, tiny_llama):
    from transformers import AutoTokenizer

    from engine import LLM, SamplingParams
    from tests.test_serve import _wait_metric

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)

    async def run():
        async with httpx.AsyncClient(base_url=fleet_url, timeout=120) as http:
            users = [None, None, "carol"]  # carol's turns go by her session, the others by their prefix
            return await asyncio.gather(*(_conversation(http, tokenizer, c, u) for c, u in enumerate(users)))

    conversations = asyncio.run(run())
    for turns in conversations:
        for before, turn in zip(turns, turns[1:]):
            # The previous turn's whole prompt (its own blocks too) was cached: the same replica
            # served both; on the other one at most the shared system prompt could hit.
            assert turn["cached"] >= len(before["prompt"]) // BS * BS > len(SHARED), (before, turn)
    turns = [t for conv in conversations for t in conv]
    llm = LLM(model=tiny_llama, **ENGINE)
    outs = llm.generate([{"prompt_token_ids": t["prompt"]} for t in turns],
                        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    llm.llm_engine.shutdown()
    assert [t["text"] for t in turns] == [o.outputs[0].text for o in outs]
    with httpx.Client(base_url=fleet_url, timeout=30) as http:
        for reason, least in (("prefix", 4), ("session", 2)):  # turns 2-3 (one at a time, on a fresh load cache)
            _wait_metric(http, "ray_rayllm_router_requests_total", lambda v, n=least: v >= n,
                         target="EngineDeployment", decision="affinity", reason=reason)
