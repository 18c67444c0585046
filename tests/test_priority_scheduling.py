"""Priority scheduling end to end (scheduling_policy="priority", vLLM's `priority`): a high-priority
request submitted behind a full batch of low-priority ones finishes first, and every request's
greedy tokens equal the fcfs engine's. The scheduler's exact orders: tests/test_scheduler_priority.py."""
import asyncio
import threading

import pytest

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.entrypoints.async_llm import AsyncLLM

KNOBS = dict(dtype="float32", device="cpu", max_num_seqs=2, max_num_batched_tokens=64)
LOW = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
HIGH = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
PROMPTS = [[(5 * i + 3 * j) % 97 + 3 for j in range(9 + 4 * i)] for i in range(3)]  # low, low, high


@pytest.fixture(scope="module")
def fcfs(tiny_llama):
    with LLM(tiny_llama, **KNOBS) as llm:
        yield llm


@pytest.fixture(scope="module")
def priority(tiny_llama):
    with LLM(tiny_llama, scheduling_policy="priority", **KNOBS) as llm:
        yield llm


@pytest.fixture(scope="module")
def reference(fcfs):
    outs = fcfs.generate([{"prompt_token_ids": p} for p in PROMPTS], [LOW, LOW, HIGH], use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_high_priority_request_behind_a_full_batch_finishes_first(priority, reference):
    engine = priority.llm_engine
    for i in range(2):
        engine.add_request(f"low{i}", {"prompt_token_ids": PROMPTS[i]}, LOW, priority=1)
    engine.step()
    engine.step()  # both slots decode low-priority requests
    assert engine.scheduler.num_running == 2
    engine.add_request("high", {"prompt_token_ids": PROMPTS[2]}, HIGH, priority=0)
    finished, tokens = [], {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished.append(out.request_id)
                tokens[out.request_id] = out.outputs[0].token_ids
    assert finished[0] == "high" and engine.scheduler.num_preemptions == 1
    assert [tokens["low0"], tokens["low1"], tokens["high"]] == reference  # the preempted one recomputed
    engine.block_manager.check_no_leak()


def test_generate_with_priorities_equals_fcfs(priority, reference):
    # Two slots for three prompts: the high-priority last prompt is admitted first.
    outs = priority.generate([{"prompt_token_ids": p} for p in PROMPTS], [LOW, LOW, HIGH],
                             use_tqdm=False, priority=[2, 1, 0])
    assert [o.outputs[0].token_ids for o in outs] == reference
    priority.llm_engine.block_manager.check_no_leak()


def test_priority_refusals(fcfs, priority):
    prompt = {"prompt_token_ids": PROMPTS[0]}
    with pytest.raises(ValueError, match="priority=1 needs scheduling_policy='priority'; this engine runs 'fcfs'") as e:
        fcfs.generate([prompt], LOW, use_tqdm=False, priority=[1])
    assert e.value.param == "priority"
    with pytest.raises(ValueError, match="got 2 priorities for 1 prompts"):
        priority.generate([prompt], LOW, use_tqdm=False, priority=[0, 1])
    with pytest.raises(ValueError, match="priority='high' is invalid: must be an integer"):
        priority.generate([prompt], LOW, use_tqdm=False, priority=["high"])
    assert fcfs.generate([prompt], LOW, use_tqdm=False, priority=[0])[0].outputs[0].token_ids  # 0 is fcfs's
    with pytest.raises(ValueError, match=r"scheduling_policy='lifo' is invalid: choose one of \('fcfs', 'priority'\)"):
        EngineConfig(model="unused", scheduling_policy="lifo")


class GatedCore(EngineCore):
    """Applies requests as they come but steps only once `gate` is set (the test queues first)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.gate = threading.Event()

    def has_work(self) -> bool:
        return self.gate.is_set() and super().has_work()


def test_async_llm_takes_a_priority(tiny_llama, reference):
    """AsyncLLM.generate(priority=...) reaches the scheduler: two requests queued on one sequence
    slot, the later one at a higher priority, which is admitted and finishes first; each has the
    fcfs engine's tokens."""
    finished = []

    async def run(llm):
        async def tokens(i, prio):
            outs = [o async for o in llm.generate({"prompt_token_ids": PROMPTS[i]}, [LOW, LOW, HIGH][i],
                                                  f"r{i}", priority=prio)]
            finished.append(f"r{i}")
            return outs[-1].outputs[0].token_ids

        tasks = [asyncio.create_task(tokens(0, 5)), asyncio.create_task(tokens(2, -1))]
        core = llm._client.core
        while llm.engine.scheduler.num_waiting < 2:  # both applied by the loop, none stepped
            await asyncio.sleep(0.01)
        core.gate.set()
        core.wakeup.set()
        return await asyncio.gather(*tasks)

    config = EngineConfig(model=tiny_llama, scheduling_policy="priority", **{**KNOBS, "max_num_seqs": 1})
    with AsyncLLM(config, engine_core_class=GatedCore) as llm:
        assert asyncio.run(run(llm)) == [reference[0], reference[2]] and finished == ["r2", "r0"]
        assert llm.engine.scheduler.num_preemptions == 0
        llm.engine.block_manager.check_no_leak()
