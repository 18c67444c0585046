"""BatchAffinityRouter's pure parts (no Ray): the LRU batch table and the least-loaded pick."""
from types import SimpleNamespace

from serve_app.replica.routing import StickyTable, least_loaded


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
