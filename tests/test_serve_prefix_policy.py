"""The prefix router's policy without Ray: the engine's block hashes, the per-replica LRU, and its
choices (prefix affinity, threshold, imbalance bound, sessions, batches, replica removal)."""
import pytest

from engine.core.block_manager import BlockManager
from engine.core.sequence import Sequence
from engine.sampling_params import SamplingParams
from serve_app.replica.prefix_policy import BlockLRU, PrefixAffinityPolicy, prompt_block_hashes, rendezvous

BS = 16
SYSTEM = list(range(100, 100 + 2 * BS))             # a shared system prompt: 2 blocks
CHAT_A = SYSTEM + list(range(500, 500 + 2 * BS))     # a conversation's history: 4 blocks
CHAT_B = SYSTEM + list(range(900, 900 + 2 * BS))


def h(ids):
    return prompt_block_hashes(ids, BS)


def loads(**queue):
    return lambda replica_id: queue.get(replica_id)


def test_prompt_hashes_are_the_engines_block_hashes():
    ids = CHAT_A + [7, 8, 9]  # 4 full blocks and a partial one, which is never hashed
    seq = Sequence("r", ids, SamplingParams())
    BlockManager(num_blocks=8, block_size=BS).get_computed_blocks(seq)  # the engine hashes the prompt here
    assert len(seq.block_hashes) == 4 and h(ids) == seq.block_hashes
    adapter = prompt_block_hashes(ids, BS, salt="sql-lora")
    assert len(adapter) == 4 and not set(adapter) & set(seq.block_hashes)  # another model's blocks never match
    assert prompt_block_hashes(ids[:BS - 1], BS) == []


def test_block_lru_matches_leading_blocks_and_forgets_tails_first():
    lru = BlockLRU(capacity=3)
    lru.insert([1, 2, 3])
    assert lru.match_length([1, 2, 9]) == 2 and lru.match_length([9, 2, 3]) == 0  # leading blocks only
    lru.insert([4])  # over capacity: the least recent goes, the first prompt's tail
    assert len(lru) == 3 and lru.match_length([1, 2, 3]) == 2


def test_the_longest_prefix_wins_and_ties_go_to_the_least_loaded():
    policy = PrefixAffinityPolicy()
    policy.record("r0", h(CHAT_A))
    policy.record("r1", h(SYSTEM))
    d = policy.choose(["r0", "r1"], loads(r0=5, r1=0), h(CHAT_A + [1] * BS))  # the next turn of A
    assert (d.replica_id, d.decision, d.reason) == ("r0", "affinity", "prefix")
    d = policy.choose(["r0", "r1"], loads(r0=5, r1=0), h(CHAT_B))  # both hold its system prompt only
    assert (d.replica_id, d.reason) == ("r1", "prefix")


def test_a_match_below_the_threshold_falls_back_to_the_least_loaded():
    policy = PrefixAffinityPolicy(match_threshold=0.6)
    policy.record("r0", h(SYSTEM))
    d = policy.choose(["r0", "r1"], loads(r0=3, r1=1), h(CHAT_B))  # 2 of 4 blocks: 0.5 < 0.6
    assert (d.replica_id, d.decision, d.reason) == ("r1", "fallback", "below_threshold")
    d = policy.choose(["r0", "r1"], loads(r0=3, r1=1), h(SYSTEM[:BS - 1]))  # no full block to match
    assert (d.replica_id, d.reason) == ("r1", "no_prefix")
    policy.match_threshold = 0.5
    assert policy.choose(["r0", "r1"], loads(r0=3, r1=1), h(CHAT_B)).replica_id == "r0"


def test_a_replica_loaded_beyond_the_bound_gives_way_to_the_least_loaded():
    policy = PrefixAffinityPolicy(imbalance_bound=4)
    policy.record("r0", h(CHAT_A))
    d = policy.choose(["r0", "r1", "r2"], loads(r0=6, r1=3, r2=1), h(CHAT_A))  # 6 - 1 > 4
    assert (d.replica_id, d.decision, d.reason) == ("r2", "fallback", "imbalanced")
    d = policy.choose(["r0", "r1", "r2"], loads(r0=5, r1=3, r2=1), h(CHAT_A))  # 5 - 1 <= 4
    assert (d.replica_id, d.reason) == ("r0", "prefix")


def test_a_removed_replicas_table_is_dropped():
    policy = PrefixAffinityPolicy()
    policy.record("r0", h(CHAT_A))
    policy.record("r1", h(SYSTEM))
    policy.retain({"r1", "r2"})
    assert set(policy.tables) == {"r1"}
    d = policy.choose(["r1", "r2"], loads(r1=0, r2=0), h(CHAT_A))  # r1 still holds its system prompt
    assert (d.replica_id, d.reason) == ("r1", "prefix")


def test_a_session_keeps_its_replica_from_every_caller_until_it_is_gone_or_overloaded():
    replicas = ["r0", "r1", "r2"]
    first = rendezvous("alice", replicas)
    other = next(r for r in replicas if r != first)
    policy = PrefixAffinityPolicy(imbalance_bound=2)
    policy.record(other, h(CHAT_A))  # another replica holds a longer prefix: the session still wins
    d = policy.choose(replicas, loads(), h(CHAT_A), session="alice")
    assert (d.replica_id, d.decision, d.reason) == (first, "affinity", "session")
    assert PrefixAffinityPolicy().choose(replicas, loads(), [], session="alice").replica_id == first  # another caller
    survivors = [first] + [r for r in replicas if r not in (first, other)]
    assert rendezvous("alice", survivors) == first  # removing another replica does not move it
    policy.record(first, h(CHAT_A), session="alice")
    busy = policy.choose(replicas, loads(**{first: 9}), h(CHAT_A), session="alice")
    assert busy.reason == "imbalanced" and busy.replica_id != first
    policy.record(busy.replica_id, h(CHAT_A), session="alice")  # it goes on where it was sent last
    assert policy.choose(replicas, loads(), h(CHAT_A), session="alice").replica_id == busy.replica_id
    gone = policy.choose([r for r in replicas if r != busy.replica_id], loads(), [], session="alice")
    assert gone.reason == "session" and gone.replica_id == rendezvous("alice", [r for r in replicas
                                                                               if r != busy.replica_id])


def test_the_micro_batch_keeps_its_replica_where_no_prefix_points_elsewhere():
    policy = PrefixAffinityPolicy()
    policy.record("r1", h(CHAT_B), batch="b7")
    policy.record("r0", h(CHAT_A))
    assert policy.choose(["r0", "r1"], loads(r0=2), h(CHAT_A), batch="b7").replica_id == "r0"  # prefix first
    d = policy.choose(["r0", "r1"], loads(r1=2), h(list(range(2000, 2000 + BS))), batch="b7")
    assert (d.replica_id, d.decision, d.reason) == ("r1", "affinity", "batch")


def test_bad_thresholds_are_refused_naming_the_arg():
    with pytest.raises(ValueError, match="prefix_match_threshold=1.5"):
        PrefixAffinityPolicy(match_threshold=1.5)
    with pytest.raises(ValueError, match="prefix_imbalance_bound=-1"):
        PrefixAffinityPolicy(imbalance_bound=-1)
