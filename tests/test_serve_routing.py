"""BatchAffinityRouter without a Ray cluster: the LRU batch table, the least-loaded pick, and the
preference for replicas holding a request's LoRA adapter (the router over Serve's fake replicas)."""
import asyncio
from types import SimpleNamespace

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata
from ray.serve._private.test_utils import FakeRunningReplica
from ray.serve.request_router import PendingRequest

from serve_app.replica.routing import BatchAffinityRouter, StickyTable, least_loaded


def test_sticky_table_is_lru():
    t = StickyTable(capacity=2)
    t.put("a", 1)
    t.put("b", 2)
    assert t.get("a") == 1  # touches a
    t.put("c", 3)           # evicts b, the least recently used
    assert (t.get("a"), t.get("b"), t.get("c")) == (1, None, 3)


def test_least_loaded_uses_known_queue_lengths():
    replicas = [SimpleNamespace(replica_id=i) for i in range(4)]
    queue = {0: 5, 1: 2, 2: None, 3: 7}  # None: not known (treated as empty)
    assert least_loaded(replicas, queue.get).replica_id == 2
    queue[2] = 9
    assert least_loaded(replicas, queue.get).replica_id == 1


def test_adapter_requests_go_to_the_replicas_holding_the_adapter():
    """Serve's multiplexed model id (a LoRA adapter: EngineRequest.multiplexed_model_id) ranks the
    replicas: those holding it, then those holding the fewest adapters, then the rest. An adapter no
    replica reports yet is placed on one of the fewest, and its requests (batched or not) follow it."""

    def pending(model_id: str, batch_id: str = "") -> PendingRequest:
        return PendingRequest(args=[], kwargs={}, metadata=RequestMetadata(
            request_id="r", internal_request_id="r", multiplexed_model_id=model_id, session_id=batch_id))

    async def run():
        router = BatchAffinityRouter(DeploymentID(name="EngineDeployment", app_name="t"),
                                     DeploymentHandleSource.UNKNOWN)
        replicas = [FakeRunningReplica("sql", model_ids={"sql@1"}), FakeRunningReplica("two", model_ids={"a@2", "b@3"}),
                    FakeRunningReplica("empty1"), FakeRunningReplica("empty2")]
        for r in replicas:
            r.set_queue_len_response(0)
        router.update_replicas(replicas)
        ranked = await router.choose_replicas(replicas, pending("sql@1"))
        batch = [await router.choose_replicas(replicas, pending("b@3", "batch-1")) for _ in range(3)]
        new = [await router.choose_replicas(replicas, pending("new@9", f"batch-{i}")) for i in range(2, 6)]
        new.append(await router.choose_replicas(replicas, pending("new@9")))
        base = await router.choose_replicas(replicas, pending(""))
        return ranked, batch, new, base

    ranked, batch, new, base = asyncio.run(run())
    names = lambda rank: [r.replica_id.unique_id for r in rank]  # noqa: E731
    assert [sorted(names(rank)) for rank in ranked] == [["sql"], ["empty1", "empty2"], ["two"]]
    assert all(names(b[0]) == ["two"] for b in batch)  # the batch's replica: the one holding b@3
    placed = names(new[0][0])
    assert placed in (["empty1"], ["empty2"]) and all(names(n[0]) == placed for n in new)  # one replica loads it
    assert len(base) == 1 and len(base[0]) == 2  # no adapter: the power of two choices over all
