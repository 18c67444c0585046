"""loadtest/cpu_quant_bench.py: a tiny run of every variant (and --stream), the check that stops a
wrong variant, arguments it refuses."""
import json

import pytest
import torch

import engine.layers.quantization.int8 as int8
from kernels import cpu_int8
from loadtest import cpu_quant_bench as bench


def test_tiny_run_times_every_variant_against_the_peer(tmp_path, capsys):
    out = tmp_path / "b.json"
    # 96 inputs: no whole AWQ group of 128 nor Q4_K block of 256, so those two are n/a there.
    report = bench.main(["--shapes", "256x32,96x16", "--rows", "1,3", "--repeats", "2", "--out", str(out)])
    rows = report["rows"]
    cells = {(tuple(r["shape"]), r["rows"], r["variant"]): r for r in rows}
    assert len(cells) == len(rows) == 2 * 2 * len(bench.VARIANTS)
    skipped = {(s, v) for (s, _, v), r in cells.items() if "skipped" in r}
    no_vnni = set() if cpu_int8.available() else {(s, "int8 W8A8 VNNI") for s in ((256, 32), (96, 16))}
    no_amx = set() if cpu_int8.amx_available() else {(s, "int8 W8A8 AMX") for s in ((256, 32), (96, 16))}
    assert skipped == {((96, 16), "int4 AWQ g128"), ((96, 16), "GGUF Q4_K")} | no_vnni | no_amx
    timed = [r for r in rows if "skipped" not in r]
    assert all(r["best_ms"] > 0 and r["median_ms"] >= r["best_ms"] and r["copies"] == 1 for r in timed)
    assert all(r["max_rel_error"] <= r["tolerance"] for r in timed)
    peer = {(tuple(r["shape"]), r["rows"]): r for r in timed if r["variant"] == bench.PEER}
    for r in timed:
        assert r["ratio_median"] == pytest.approx(peer[tuple(r["shape"]), r["rows"]]["median_ms"] / r["median_ms"])
    bpw = {r["variant"]: r["bytes_per_weight"] for r in timed if r["shape"] == [256, 32]}
    assert bpw["fp32 oneDNN"] == bpw["fp32 F.linear"] == 4 and bpw["bf16 oneDNN"] == 2
    assert bpw["int4 AWQ g128"] < bpw["GGUF Q4_K"] < bpw["FP8 W8A16"] < bpw["GGUF Q8_0"] < 2
    saved = json.loads(out.read_text())
    assert saved["rows"] == rows and saved["git_commit"] and saved["peer"] == bench.PEER
    printed = capsys.readouterr().out
    assert "int4 AWQ g128" in printed and "B/w" in printed and "n/a" in printed


def test_stream_copies_each_layer_past_the_cache(tmp_path):
    cache_mib = 0.05
    rows = bench.main(["--shapes", "256x32", "--rows", "2", "--repeats", "1", "--stream", "--cache-mib",
                       str(cache_mib), "--variants", "fp32 oneDNN,int4 AWQ g128", "--out",
                       str(tmp_path / "b.json")])["rows"]
    assert [r["variant"] for r in rows] == ["fp32 oneDNN", "int4 AWQ g128"]
    for r in rows:  # a pass over the copies reads at least twice the cache
        assert r["copies"] * r["bytes_per_weight"] * 256 * 32 >= bench.STREAM_FACTOR * cache_mib * (1 << 20)
    assert rows[1]["copies"] > rows[0]["copies"] > 1


def test_a_wrong_variant_stops_the_run(tmp_path, monkeypatch):
    monkeypatch.setattr(int8, "w8a8_matmul", lambda qx, xs, q, s, dtype: torch.zeros(qx.shape[0], q.shape[0]))
    with pytest.raises(RuntimeError, match=r"int8 W8A8, 256x32, 1 rows: output differs .* above its tolerance"):
        bench.main(["--shapes", "256x32", "--rows", "1", "--repeats", "1", "--variants", "int8 W8A8",
                    "--out", str(tmp_path / "b.json")])
    assert not (tmp_path / "b.json").exists()


@pytest.mark.skipif(not cpu_int8.available(), reason="no AVX-512 VNNI here, or no C compiler")
def test_a_wrong_vnni_kernel_stops_the_run(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_int8, "int8_linear_cpu", lambda x, w, s, isa="auto": torch.zeros(x.shape[0], w.shape[0]))
    with pytest.raises(RuntimeError, match=r"int8 W8A8 VNNI, 256x32, 1 rows: output differs"):
        bench.main(["--shapes", "256x32", "--rows", "1", "--repeats", "1", "--variants", "int8 W8A8 VNNI",
                    "--out", str(tmp_path / "b.json")])


@pytest.mark.skipif(not cpu_int8.amx_available(), reason="no AMX here")
def test_a_wrong_amx_tile_stops_the_run(tmp_path, monkeypatch):
    """The AMX variant runs the kernel on auto: a wrong result from 8 rows on is caught."""
    real = cpu_int8.int8_linear_cpu
    monkeypatch.setattr(cpu_int8, "int8_linear_cpu",
                        lambda x, w, s, isa="auto": real(x, w, s, isa) * (1 if x.shape[0] < 8 else 2))
    with pytest.raises(RuntimeError, match=r"int8 W8A8 AMX, 256x32, 8 rows: output differs"):
        bench.main(["--shapes", "256x32", "--rows", "1,8", "--repeats", "1", "--variants", "int8 W8A8 AMX",
                    "--out", str(tmp_path / "b.json")])


@pytest.mark.parametrize("argv, message", [
    (["--rows", "1,0"], "expected positive integers separated by commas, got '1,0'"),
    (["--shapes", "512x"], "expected INxOUT shapes separated by commas, got '512x'"),
    (["--variants", "int3"], "unknown variant(s) ['int3']"),
    (["--stream", "--cache-mib", "0"], "--cache-mib must be positive, got 0.0"),
])
def test_refuses_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench.main(argv)
    assert message in capsys.readouterr().err
