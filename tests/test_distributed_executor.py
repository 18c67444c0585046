"""Tensor parallelism end to end on CPU: 2 ranks (gloo) equal HF token for token."""
import random

import pytest
import torch

from engine import LLM, EngineConfig, SamplingParams
from tests.hf_reference import assert_matches, hf_greedy


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen2"])  # qwen2's single KV head is replicated
def test_tp2_greedy_equals_hf(arch, request):
    path = request.getfixturevalue(arch)
    llm = LLM(path, device="cpu", dtype="float32", tensor_parallel_size=2, max_num_batched_tokens=64)
    try:
        rng = random.Random(3)
        vocab = llm.llm_engine.model_config.vocab_size
        prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (3, 40, 150)]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
        for p, o in zip(prompts, outs):
            assert_matches(o.outputs[0].token_ids, hf_greedy(path, p, 12), f"tp=2, {len(p)} tokens")
        llm.llm_engine.block_manager.check_no_leak()
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize("device, backend", [("cpu", "gloo"), ("cuda", "nccl")])
def test_tp_backend_follows_the_engine_device_not_the_machine(monkeypatch, device, backend):
    """device='cpu' on a GPU host once picked NCCL, which cannot reduce CPU tensors."""
    from engine import distributed_executor

    seen = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU host, as far as we know
    monkeypatch.setattr(distributed_executor, "init_tp_group",
                        lambda rank, size, method, backend=None: seen.update(backend=backend))
    config = EngineConfig(model="unused", device=device, tensor_parallel_size=2,
                          distributed_init_method="tcp://127.0.0.1:1")
    distributed_executor._init_group(0, config)
    assert seen["backend"] == backend
