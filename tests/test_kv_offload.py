"""The host KV tier (kv_offload_gb): the block manager's plan with exact block ids
(engine/core/kv_offload.py), the worker's copies (engine/worker/host_kv_cache.py), and an engine
whose pool is too small for its working set, with and without the tier: identical greedy
tokens, more cached tokens with it, and preemption that swaps instead of recomputing.
Random interleavings: tests/test_scheduler_properties.py (host_blocks)."""
from types import SimpleNamespace

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.kv_offload import HostBlockPool, OffloadingBlockManager
from engine.core.sequence import Sequence
from engine.worker.host_kv_cache import HostKVCache, _runs

BS = 4
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _seq(tokens) -> Sequence:
    return Sequence("r", list(tokens), SamplingParams(max_tokens=1))


def _run_prefill(bm, seq) -> list[int]:
    """Admit `seq` with its cache hits, compute its whole prompt, register its full blocks."""
    num_cached = bm.get_computed_blocks(seq)
    assert bm.allocate_slots(seq, seq.num_tokens - num_cached, num_computed_from_cache=num_cached)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)
    return list(seq.block_table)


def test_evicted_block_goes_to_the_host_and_a_hit_comes_back_from_it():
    bm = OffloadingBlockManager(num_blocks=4, block_size=BS, num_host_blocks=4)
    a = _seq(range(9))
    assert _run_prefill(bm, a) == [0, 1, 2] and bm.take_swaps() == ([], [])
    bm.free(a)  # blocks 0, 1 cached; 2 (partial) first in the free queue: [2, 3, 1, 0]
    b = _seq(range(100, 112))
    assert _run_prefill(bm, b) == [2, 3, 1]  # evicts a's second block (1): its KV goes to host block 0
    assert bm.take_swaps() == ([(1, 0)], [])
    bm.free(b)  # b's 3 blocks cached too: the free queue is [0, 1, 3, 2]
    a2 = _seq(range(9))
    assert bm.get_computed_blocks(a2) == 8  # block 0 still on the device, block 1 on the host
    assert bm.allocate_slots(a2, 1, num_computed_from_cache=8)
    # Device hit 0 taken first; the host hit gets block 1 (registered at once), whose own cached
    # KV (b's third block) goes to host block 1 first: in one step, out before in. Block 3 is new
    # (b's second block: to host block 2).
    assert a2.block_table == [0, 1, 3] and a2.num_computed_tokens == 8
    assert bm.take_swaps() == ([(1, 1), (3, 2)], [(0, 1)])
    assert bm.block_hashes[1] == a2.block_hashes[1] and bm.num_host_hit_tokens == 4 and bm.num_hit_tokens == 8
    assert (bm.host.num_swapped_out, bm.host.num_swapped_in) == (3, 1)
    a2.num_computed_tokens = a2.num_tokens
    bm.free(a2)  # the free queue is [3, 2, 1, 0]
    c = _seq(range(200, 216))
    assert _run_prefill(bm, c) == [3, 2, 1, 0]
    # Block 1 (a's second block again) still has its host copy (the tier is inclusive): no copy.
    # The host is then full, so a's first block replaces the least recently used, b's third.
    assert bm.take_swaps() == ([(2, 3), (0, 1)], [])
    assert (bm.host.num_swapped_out, bm.host.num_swapped_in) == (5, 1)
    bm.free(c)
    bm.check_no_leak()


def test_host_blocks_in_a_steps_copies_are_not_reused_in_that_step():
    pool = HostBlockPool(2)
    pool.store(10, 0xA)
    pool.store(11, 0xB)
    pool.store(12, 0xC)  # both host blocks are written this step: C is dropped, not written twice
    assert pool.take_plan() == ([(10, 0), (11, 1)], []) and 0xC not in pool
    pool.reserve(0xA)  # a hit on A is being loaded this step: A's block must survive the step
    pool.store(13, 0xC)  # so C replaces B, the least recently used one not in the step's copies
    pool.load(0xA, 7)
    assert pool.take_plan() == ([(13, 1)], [(0, 7)])
    assert 0xA in pool and 0xB not in pool and 0xC in pool
    pool.store(14, 0xA)  # already on the host: touched, no copy
    assert pool.take_plan() == ([], []) and list(pool.cached) == [0xC, 0xA]
    pool.check_invariants()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
def test_host_kv_cache_copies_every_layers_bytes_out_and_back(dtype, device):
    """Two layers' K and V caches of 6 blocks; blocks 1, 4 out to host blocks 2, 3, overwritten,
    then back into blocks 5, 0: byte for byte, any dtype (fp8 KV included). On CUDA the host
    blocks are pinned and the copies run on their own stream, ordered before the compute stream's
    next work."""
    shape = (6, BS, 2, 8)
    layers = [SimpleNamespace(k_cache=torch.randn(shape).to(dtype).to(device),
                              v_cache=torch.randn(shape).to(dtype).to(device)) for _ in range(2)]
    before = [(a.k_cache.clone(), a.v_cache.clone()) for a in layers]
    cache = HostKVCache(layers, num_host_blocks=4, device=torch.device(device))
    assert cache.blocks.is_pinned() == (device == "cuda")
    cache.swap([(1, 2), (4, 3)], [])
    for a in layers:
        a.k_cache.view(torch.uint8).zero_()
        a.v_cache.view(torch.uint8).zero_()
    cache.swap([], [(2, 5), (3, 0)])
    for a, (k, v) in zip(layers, before):
        for src, dst in ((1, 5), (4, 0)):
            assert torch.equal(a.k_cache[dst].view(torch.uint8), k[src].view(torch.uint8))
            assert torch.equal(a.v_cache[dst].view(torch.uint8), v[src].view(torch.uint8))
        assert not a.k_cache[1].view(torch.uint8).any()  # only the swapped-in blocks were written


def test_runs_of_consecutive_host_blocks():
    assert _runs([7, 8, 9, 2, 3, 5]) == [(0, 7, 3), (3, 2, 2), (5, 5, 1)] and _runs([]) == []


# -- an engine whose pool is smaller than its working set --------------------------------------
KNOBS = dict(dtype="float32", device="cpu", num_kv_blocks=8, max_num_seqs=2, max_num_batched_tokens=128)
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def engines(tiny_llama):
    with LLM(tiny_llama, **KNOBS) as plain, LLM(tiny_llama, kv_offload_gb=0.001, **KNOBS) as tiered:
        yield plain, tiered


@CUDA
def test_cuda_multi_turn_with_the_host_tier_equals_without(tiny_llama):
    """The CUDA path: pinned host blocks, a copy stream, overlapped scheduling (on by default)."""
    knobs = {**KNOBS, "device": "cuda"}
    with LLM(tiny_llama, kv_offload_gb=0, **knobs) as plain, LLM(tiny_llama, kv_offload_gb=0.001, **knobs) as tiered:
        answers, cached = _multi_turn(plain)
        tier_answers, tier_cached = _multi_turn(tiered)
        assert tier_answers == answers and tier_cached[3:] == [48, 48, 48] and sum(tier_cached) > sum(cached)
        assert tiered.llm_engine.get_stats()["kv_offload_blocks_in"] > 0


def _stats_delta(llm, run):
    before = llm.llm_engine.get_stats()
    result = run()
    after = llm.llm_engine.get_stats()
    return result, {k: after[k] - before[k] for k in ("prefix_cache_hits", "prefix_cache_host_hits",
                                                      "kv_offload_blocks_out", "kv_offload_blocks_in",
                                                      "num_preemptions")}


def _multi_turn(llm):
    """3 conversations x 2 turns, one request at a time: each turn's prompt is the previous
    prompt, its answer and 8 new tokens. 8 blocks of 16 tokens hold less than the 3 histories."""
    history = [[(37 * c + 11 * j) % 900 + 50 for j in range(48)] for c in range(3)]
    answers, cached = [], []
    for turn in range(2):
        for c in range(3):
            out = llm.generate([{"prompt_token_ids": history[c]}], GREEDY, use_tqdm=False)[0]
            answers.append(out.outputs[0].token_ids)
            cached.append(out.num_cached_tokens)
            history[c] = history[c] + list(out.outputs[0].token_ids) + [(c + 5 * j) % 900 + 50 for j in range(8)]
    return answers, cached


def test_multi_turn_with_the_host_tier_hits_more_with_identical_tokens(engines):
    plain, tiered = engines
    (answers, cached), plain_stats = _stats_delta(plain, lambda: _multi_turn(plain))
    (tier_answers, tier_cached), tier_stats = _stats_delta(tiered, lambda: _multi_turn(tiered))
    assert tier_answers == answers
    # Turn 2 of each conversation: its history was evicted from the device by the others'.
    assert sum(tier_cached[3:]) > sum(cached[3:]) and tier_cached[3:] == [48, 48, 48]
    assert tier_stats["prefix_cache_host_hits"] == 16 * tier_stats["kv_offload_blocks_in"] > 0  # 16-token blocks
    assert (tier_stats["prefix_cache_hits"], plain_stats["prefix_cache_hits"]) == (sum(tier_cached), sum(cached))
    for llm in engines:
        llm.llm_engine.block_manager.check_no_leak()


def test_preemption_swaps_instead_of_recomputing_with_the_same_tokens(engines):
    """Two 64-token prompts (4 blocks each) in 8 blocks: the first one's decodes preempt the
    second, then take two of its blocks. With the tier those go to the host and come back when
    it is readmitted (after the first one finishes: it needs 5 blocks)."""
    prompts = [{"prompt_token_ids": [(29 * i + 3 * j) % 900 + 50 for j in range(64)]} for i in range(2)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    results = {}
    for name, llm in zip(("plain", "tiered"), engines):
        outs, stats = _stats_delta(llm, lambda: llm.generate(prompts, params, use_tqdm=False))
        results[name] = ([o.outputs[0].token_ids for o in outs], stats)
    (plain_tokens, plain_stats), (tier_tokens, tier_stats) = results["plain"], results["tiered"]
    assert plain_stats["num_preemptions"] >= 1 and tier_stats["num_preemptions"] >= 1
    assert tier_tokens == plain_tokens
    assert tier_stats["prefix_cache_host_hits"] == 32  # the preempted prompt's two evicted blocks came back
    assert tier_stats["prefix_cache_hits"] > plain_stats["prefix_cache_hits"]


def test_kv_offload_refusals(tiny_llama):
    with pytest.raises(ValueError, match=r"kv_offload_gb=1e-06 holds no KV block \(8192 bytes per block"):
        LLM(tiny_llama, dtype="float32", device="cpu", num_kv_blocks=8, kv_offload_gb=1e-6)


def test_reset_prefix_cache_empties_the_host_tier_too():
    bm = OffloadingBlockManager(num_blocks=4, block_size=BS, num_host_blocks=4)
    a = _seq(range(9))
    _run_prefill(bm, a)
    bm.free(a)
    b = _seq(range(100, 112))
    _run_prefill(bm, b)  # a's second block to the host
    assert len(bm.host.cached) == 1 and not bm.reset_prefix_cache()  # b holds blocks, a copy is planned
    bm.take_swaps()
    bm.free(b)
    assert bm.reset_prefix_cache()
    assert not bm.host.cached and len(bm.host.free_ids) == 4 and bm.get_computed_blocks(_seq(range(9))) == 0
    bm.host.check_invariants()
    bm.check_no_leak()
