"""loadtest/lora_bench.py on CPU: the rows it reports, dry-run under the Triton interpreter with
tiny shapes and a stand-in timer (the figures need a GPU)."""

import argparse

import torch

from tests.triton_device import DEVICE  # before kernels: sets the interpreter up

from loadtest import lora_bench as lb  # noqa: E402


def test_rows_compare_the_kernels_with_the_torch_loop(monkeypatch, capsys):
    calls = []

    def bench_ms(fn):
        fn()
        calls.append(1)
        return float(len(calls))  # triton first: 1 ms, then torch: 2 ms
    monkeypatch.setattr(lb, "DEVICE", DEVICE)
    monkeypatch.setattr(lb, "bench_ms", bench_ms)
    tiny = argparse.Namespace(rank=8, max_loras=2)
    row = lb.run_case("qkv_proj", 5, 40, [24, 8, 8], tiny, torch.float32)
    assert row["case"] == "qkv_proj x5" and row["adapters"] == 2  # rows: base, 0, 1, base, 0
    assert row["max_abs_diff_vs_torch"] < 1e-4 and row["speedup"] == 2.0
    # A [24, 40] and B's diagonal blocks [40, 8] per adapter, x read, y read and written (fp32).
    assert row["bytes"] == 2 * 8 * (3 * 40 + 40) * 4 + 5 * 40 * 4 + 2 * 5 * 40 * 4
    assert "qkv_proj x5" in lb.format_rows([row]).splitlines()[-1]
    if not torch.cuda.is_available():
        assert lb.main([]) == 0
        assert "needs CUDA" in capsys.readouterr().out
