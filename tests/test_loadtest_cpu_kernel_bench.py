"""loadtest/cpu_kernel_bench.py: the cases it reports, each against its peer, and its JSON."""
import json

import pytest
import torch

from kernels.cpu_attention import (AMX_BF16_KERNEL_MAX_Q_LEN, AMX_CHUNK_ROW_MAX_Q_LEN, KERNEL_MAX_Q_LEN,
                                   _chunk_kernel, kernel_available)
from loadtest import cpu_kernel_bench as ckb


def test_attention_cases_straddle_the_kernel_limit(tmp_path, capsys):
    if not kernel_available():
        pytest.skip("the C attention kernel is not built here")
    out = tmp_path / "b.json"
    report = ckb.main(["--only", "attention", "--repeats", "1", "--out", str(out)])
    rows = report["rows"]
    # The kernel and SDPA computed the same attention (main checks), for chunks on both sides.
    q_lens = [q for q, _ in ckb.ATTENTION_CASES]
    assert min(q_lens) <= AMX_CHUNK_ROW_MAX_Q_LEN < AMX_BF16_KERNEL_MAX_Q_LEN < KERNEL_MAX_Q_LEN < max(q_lens)
    # Where the AMX chunk kernel runs, each bf16 case has a second row: that kernel against SDPA.
    bf16_ours = ["C row kernel", "AMX chunk kernel"] if _chunk_kernel() is not None else ["C row kernel"]
    assert [r["peer"] for r in rows] == ["SDPA"] * len(q_lens) * (1 + len(bf16_ours))
    assert [(r["case"].split()[1], r["ours"]) for r in rows] == \
        [("float32", "C row kernel")] * len(q_lens) + [("bfloat16", o) for _ in q_lens for o in bf16_ours]
    assert all(r["ratio"] == pytest.approx(r["peer_ms"] / r["ours_ms"]) for r in rows)
    saved = json.loads(out.read_text())
    assert saved["rows"] == rows and saved["git_commit"] and saved["machine"]["cpu_count"]
    assert "peer / ours" in capsys.readouterr().out


def test_linear_cases_cover_decode_and_prefill_rows(tmp_path, monkeypatch):
    monkeypatch.setattr(ckb, "LINEAR_ROWS", (4, 64))  # the 2048-row case is slow for a test
    rows = ckb.main(["--only", "linear", "--repeats", "1", "--out", str(tmp_path / "b.json")])["rows"]
    if rows:  # empty only on a torch without oneDNN, which the bench says
        assert [r["case"] for r in rows] == ["linear x24, 4 rows", "linear x24, 64 rows"]
        assert all(r["ours_ms"] > 0 and r["peer_ms"] > 0 for r in rows)


def test_decode_cases_report_the_kernel_against_the_torch_path_and_a_plain_read(tmp_path, monkeypatch):
    if not kernel_available():
        pytest.skip("the C attention kernel is not built here")
    monkeypatch.setattr(ckb, "DECODE_CASES", ((3, (1, 40), torch.float32, 8, 4, 64),
                                              (2, (15, 17), torch.bfloat16, 9, 3, 64)))
    rows = ckb.main(["--only", "decode", "--repeats", "1", "--out", str(tmp_path / "b.json")])["rows"]
    assert [r["case"] for r in rows] == ["decode 3 x 1-40 keys, 8/4 heads x 64, float32 (0 MiB K/V)",
                                         "decode 2 x 15-17 keys, 9/3 heads x 64, bfloat16 (0 MiB K/V)"]
    assert all(r["peer"] == "torch path" and r["kv_gb_per_s"] > 0 and r["read_share"] > 0 for r in rows)


def test_ops_cases_time_each_fused_op_against_its_torch_ops(tmp_path, monkeypatch):
    from kernels import cpu_ops
    if cpu_ops._lib() is None:
        pytest.skip("the C ops are not built here")
    monkeypatch.setattr(ckb, "OPS_ROWS", (3,))
    rows = ckb.main(["--only", "ops", "--repeats", "1", "--out", str(tmp_path / "b.json")])["rows"]
    from kernels import cpu_int8
    gated = ["int8 gate_up + silu_and_mul %s 3 x 512 -> 2 x 1408"] if cpu_int8.amx_available() else []
    assert [r["case"] for r in rows] == [
        "add + rms_norm float32 3 x 512", "silu_and_mul float32 3 x 2 x 1408", *(g % "float32" for g in gated),
        "add + rms_norm bfloat16 3 x 512", "silu_and_mul bfloat16 3 x 2 x 1408", *(g % "bfloat16" for g in gated)]
    assert all(r["peer"] in ("torch ops", "int8 matmul, then the C op") and r["ours_ms"] > 0 and r["peer_ms"] > 0
               for r in rows)


def test_refuses_zero_repeats(capsys):
    with pytest.raises(SystemExit):
        ckb.main(["--repeats", "0"])
    assert "--repeats must be at least 1, got 0" in capsys.readouterr().err
