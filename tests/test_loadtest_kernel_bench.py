"""loadtest/kernel_bench.py on CPU: the rows it reports and the knob sweep, dry-run under
the Triton interpreter with tiny shapes and a stand-in timer (the figures need a GPU)."""

import argparse

import torch

from tests.triton_device import DEVICE  # before kernels: sets the interpreter up

import kernels.triton_attention as ta  # noqa: E402
from loadtest import kernel_bench as kb  # noqa: E402

TINY = argparse.Namespace(heads=4, kv_heads=2, head_dim=16, block_size=16)


def fake_timer(monkeypatch):
    """bench_ms runs the function once and reports 1 ms per launch-config it saw."""
    calls = []

    def bench_ms(fn):
        fn()
        calls.append(1)
        return float(len(calls))
    monkeypatch.setattr(kb, "DEVICE", DEVICE)
    monkeypatch.setattr(kb, "bench_ms", bench_ms)
    return calls


def test_decode_rows_report_split_unsplit_and_torch(monkeypatch):
    fake_timer(monkeypatch)
    # 1 seq x 2 KV heads on the interpreter's 4 stand-in SMs: the heuristic splits.
    row = kb.run_attention_case("decode 1x600", [1], [600], TINY, torch.float32)
    assert row["splits"] > 1 and row["split_n"] == row["splits"]
    assert row["triton_ms"] == row["split_ms"] and row["unsplit_ms"] != row["split_ms"]
    assert row["max_abs_diff_vs_torch"] < 1e-3
    # Many sequences: the heuristic keeps the plain kernel; split still timed for comparison.
    row = kb.run_attention_case("decode 8x64", [1] * 8, [64] * 8, TINY, torch.float32)
    assert row["splits"] == 1 and row["split_n"] == kb.FORCED_SPLITS
    assert row["triton_ms"] == row["unsplit_ms"]
    table = kb.format_rows([row], copy_rate=1.0)
    assert "split vs unsplit vs torch" in table and "decode 8x64" in table.splitlines()[-1]
    prefill = kb.run_attention_case("prefill", [20], [20], TINY, torch.float32)
    assert "unsplit_ms" not in prefill and prefill["splits"] == 1


def test_sweep_restores_knobs_and_records_failures(monkeypatch):
    fake_timer(monkeypatch)
    monkeypatch.setattr(kb, "ATTENTION_CASES", {"decode 2x100": ([1, 1], [100, 70]),
                                                "chunk": ([5], [40])})
    rows = kb.sweep(TINY, torch.float32, ["NUM_SPLITS", "KV_TILE"])
    assert ta.NUM_SPLITS is None and ta.KV_TILE is None
    split_rows = [r for r in rows if r["knob"] == "NUM_SPLITS"]
    assert [r["splits"] for r in split_rows] == list(kb.SWEEP_KNOBS["NUM_SPLITS"][1])
    assert {r["case"] for r in split_rows} == {"decode 2x100"}  # split knobs: decode only
    assert len([r for r in rows if r["knob"] == "KV_TILE"]) == 2 * 4
    monkeypatch.setitem(kb.SWEEP_KNOBS, "KV_TILE", ("kernels.triton_attention", (24,)))
    bad = kb.sweep(TINY, torch.float32, ["KV_TILE"])
    assert all("KV_TILE" in r["error"] for r in bad) and ta.KV_TILE is None


def test_moe_rows_compare_the_kernel_with_the_torch_path(monkeypatch):
    fake_timer(monkeypatch)
    tiny = argparse.Namespace(moe_experts=8, moe_top_k=2, moe_hidden=32, moe_inter=16)
    rows = [kb.run_moe_case(n, tiny, torch.float32) for n in (1, 16)]
    assert [r["case"] for r in rows] == ["moe decode 1", "moe decode 16"]
    assert rows[0]["experts_reached"] == 2 and rows[1]["experts_reached"] <= 8
    assert all(r["max_abs_diff_vs_torch"] < 1e-4 and r["speedup"] > 0 for r in rows)
    assert "moe decode 16" in kb.format_rows(rows, copy_rate=1.0)


def test_main_without_cuda_exits_cleanly(capsys):
    if torch.cuda.is_available():
        return
    assert kb.main(["--sweep"]) == 0
    assert "needs CUDA" in capsys.readouterr().out
