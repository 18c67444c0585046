"""loadtest/cpu_fused_bench.py: real steps replayed fused and through the modules, equal logits, its JSON."""
import json

import pytest

from engine.tools.tiny_model import make_tiny_model
from kernels import cpu_decoder_layer
from loadtest import cpu_fused_bench


@pytest.mark.skipif(not cpu_decoder_layer.available(), reason="no AVX-512 VNNI here, or no C compiler")
def test_replays_a_prefill_and_a_decode_step_both_ways(tmp_path, monkeypatch):
    tiny = make_tiny_model(tmp_path / "tiny", arch="llama", seed=0)  # the bench model's role, smaller
    monkeypatch.setattr(cpu_fused_bench, "ensure_bench_model", lambda path: tiny)
    out = tmp_path / "b.json"
    report = cpu_fused_bench.main(["--repeats", "1", "--out", str(out)])
    rows = report["rows"]
    assert [r["step"].split(":")[0] for r in rows] == ["prefill", "decode"]
    assert "64 tokens, 64 sequences" in rows[1]["step"]
    assert all(r["fused_ms"] > 0 and r["modules_ms"] > 0 and r["ratio"] == r["modules_ms"] / r["fused_ms"]
               for r in rows)
    assert json.loads(out.read_text())["rows"] == rows
