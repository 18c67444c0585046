"""PrefixAffinityRouter on Serve's router API, driven as Serve drives it in a caller, without a
cluster. The policy alone: tests/test_serve_prefix_policy.py."""
import asyncio

import pytest
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata
from ray.serve.request_router import PendingRequest, ReplicaID

from engine.sampling_params import SamplingParams
from serve_app.http.messages import EngineRequest
from serve_app.replica import prefix_routing
from serve_app.replica.routing import RouterMetrics
from tests.fake_metrics import Recorder

BS = 16  # the engine's default block_size
SHARED = list(range(40, 40 + 3 * BS))  # a system prompt of 3 blocks
TURN_LEN = 20                          # a user message adds a block of the conversation's own


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
