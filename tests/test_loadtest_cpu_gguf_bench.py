"""loadtest/cpu_gguf_bench.py: a smoke run at tiny sizes, its check of the kernel, its JSON."""
import json

import pytest
import torch

from loadtest import cpu_gguf_bench as bench


def test_tiny_run_covers_types_and_rows(tmp_path, capsys):
    out = tmp_path / "b.json"
    report = bench.main(["--out-features", "20", "--in", "256", "--rows", "1", "17", "--repeats", "1",
                         "--types", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "--out", str(out)])
    rows = report["rows"]
    assert [(r["type"], r["rows"]) for r in rows] == [(t, n) for t in ("Q4_1", "Q5_0", "Q5_1", "Q4_K") for n in (1, 17)]
    assert all(r["cpu_gguf_ms"] > 0 and r["deq_linear_ms"] > 0 and r["dense_ms"] > 0 for r in rows)
    saved = json.loads(out.read_text())
    assert saved["rows"] == rows and saved["shape"] == [20, 256] and saved["git_commit"]
    assert "cpu_gguf ms" in capsys.readouterr().out


def test_a_wrong_kernel_result_stops_the_run(tmp_path, monkeypatch):
    monkeypatch.setattr(bench.cpu_gguf, "gguf_linear_cpu", lambda x, w, qtype: torch.zeros(x.shape[0], w.shape[0]))
    with pytest.raises(RuntimeError, match="Q5_1, 1 rows: cpu_gguf differs from dequantize"):
        bench.main(["--out-features", "4", "--in", "64", "--rows", "1", "--repeats", "1", "--types", "Q5_1",
                    "--out", str(tmp_path / "b.json")])


def test_refuses_features_off_the_block(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--in", "96", "--types", "Q4_K"])
    assert "--in 96 is not a multiple of Q4_K's block of 256" in capsys.readouterr().err
