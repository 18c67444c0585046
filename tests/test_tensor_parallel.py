"""Tensor parallelism on CPU: 2 gloo processes run the TP-sharded model and must produce the
tp=1 logits. One checkpoint splits its 2 KV heads across the ranks, the other replicates its
single KV head; an odd vocab exercises the padded vocab shards."""
import pytest
import torch
import torch.multiprocessing as mp

from engine.executor.parallel_state import (destroy_tp_group, get_tp_rank, get_tp_size, init_tp_group,
                                tensor_model_parallel_all_gather, tensor_model_parallel_all_reduce)
from engine.executor.network_utils import free_port
from test_models import attach_kv_cache, build_hf_checkpoint, load_our_model, prompts, run_step

TP_SIZE = 2
CASES = {"llama-kv2": dict(arch="llama", num_key_value_heads=2),
         "qwen2-kv1": dict(arch="qwen2", num_key_value_heads=1),
         "phi3-kv2": dict(arch="phi3", num_key_value_heads=2)}  # fused qkv / gate_up tensors split per rank


def _run(path) -> torch.Tensor:
    """Prefill of two prompts, then one decode step: logits of every row."""
    model = load_our_model(path)
    seqs = prompts(model.config.vocab_size, lengths=(7, 20))
    attach_kv_cache(model, len(seqs))
    prefill = run_step(model, [(s, t, 0) for s, t in enumerate(seqs)])
    decode = run_step(model, [(s, [3], len(t)) for s, t in enumerate(seqs)])
    return torch.cat([prefill, decode])


def _worker(rank: int, port: int, paths: list, out_dir) -> None:
    torch.set_num_threads(1)  # two ranks share the CPU cores
    init_tp_group(rank, TP_SIZE, f"tcp://127.0.0.1:{port}", backend="gloo")  # a CPU test, GPU or not
    try:
        assert (get_tp_rank(), get_tp_size()) == (rank, TP_SIZE)
        x = torch.full((2, 3), float(rank + 1))
        assert tensor_model_parallel_all_reduce(x.clone()).eq(3.0).all()
        assert tensor_model_parallel_all_gather(x, dim=-1).shape == (2, 6)
        for i, path in enumerate(paths):
            logits = _run(path)
            if rank == 0:
                torch.save(logits, out_dir / f"logits{i}.pt")
    finally:
        destroy_tp_group()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    paths = []
    for name, case in CASES.items():
        path = tmp_path_factory.mktemp(name)
        build_hf_checkpoint(case["arch"], path, vocab_size=251,
                            num_key_value_heads=case["num_key_value_heads"])
        paths.append(path)
    return paths


def test_tp2_logits_equal_tp1(checkpoints, tmp_path):
    mp.spawn(_worker, args=(free_port(), checkpoints, tmp_path), nprocs=TP_SIZE, join=True)
    for i, path in enumerate(checkpoints):
        expected = _run(path)
        got = torch.load(tmp_path / f"logits{i}.pt")
        assert got.shape == expected.shape == (7 + 20 + 2, 251)
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_single_process_defaults():
    assert (get_tp_rank(), get_tp_size()) == (0, 1)
    x = torch.ones(2, 3)
    assert tensor_model_parallel_all_reduce(x) is x
    assert tensor_model_parallel_all_gather(x) is x
    with pytest.raises(ValueError, match="rank=2"):
        init_tp_group(2, 2, "tcp://127.0.0.1:1")
