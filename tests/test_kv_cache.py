"""KV-cache memory: zero-filled, and on CPU resident only once used (the 4 GiB default budget
once became 4 GiB of RSS at start-up)."""
import torch

from engine import LLM, SamplingParams
from engine.worker.kv_cache import allocate_kv_tensor


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_cpu_kv_tensor_is_zero_and_writable():
    t = allocate_kv_tensor((3, 16, 2, 8), torch.bfloat16, torch.device("cpu"))
    assert t.shape == (3, 16, 2, 8) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert not t.any()
    t[1, 2] = 1.5
    assert t.sum().item() == 1.5 * 16


def test_cpu_kv_cache_is_touched_only_when_used(tiny_llama):
    with LLM(tiny_llama, device="cpu", dtype="float32", num_kv_blocks=8):
        pass  # libraries loaded, allocator warm: what follows measures the cache alone
    before = _rss_bytes()
    with LLM(tiny_llama, device="cpu", dtype="float32", cpu_kv_cache_gb=1.0, max_num_seqs=4096) as llm:
        runner = llm.llm_engine.executor.runner
        kv_bytes = runner.kv_cache_bytes
        assert kv_bytes > 0.9 * 2**30  # the whole budget was granted...
        grown = _rss_bytes() - before
        assert grown < 0.1 * kv_bytes, f"RSS grew {grown / 2**20:.0f} MiB for a {kv_bytes / 2**20:.0f} MiB cache"
        out = llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=4, ignore_eos=True),
                           use_tqdm=False)  # ... and works
        assert len(out[0].outputs[0].token_ids) == 4
