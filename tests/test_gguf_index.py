"""engine.loader.gguf_index against gguf's own reader: the same tensors (bytes, shapes, types, offsets)
and the same scalar metadata, on files written here (tests/gguf_writer.py: tokenizer arrays included)
and on the demo model when it is on this machine; broken files fail naming what is wrong."""
import struct

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader

from engine.loader.gguf_index import GGUFIndex
from tests.gguf_writer import write_gguf


def _assert_same(path):
    ours, theirs = GGUFIndex(path), GGUFReader(path)
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert (a.tensor_type, a.n_elements, a.n_bytes, a.data_offset) == \
               (b.tensor_type, int(b.n_elements), int(b.n_bytes), int(b.data_offset)), a.name
        assert a.shape.tolist() == b.shape.tolist() and a.data.shape == b.data.shape, a.name
        assert a.data.dtype == b.data.dtype and np.array_equal(a.data, b.data, equal_nan=True), a.name
    scalars = {k: f.contents() for k, f in theirs.fields.items()
               if not k.startswith("GGUF.") and f.types[0] != gguf.GGUFValueType.ARRAY}
    assert {k: f.contents() for k, f in ours.fields.items()} == scalars
    assert any(f.types[0] == gguf.GGUFValueType.ARRAY for f in theirs.fields.values())  # arrays were stepped over
    return ours


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.Q8_0, Q.Q4_0], ids=lambda q: q.name)
def test_same_tensors_and_metadata_as_ggufs_reader(tiny_qwen2, qtype, tmp_path):
    write_gguf(tiny_qwen2, tmp_path / "model.gguf", qtype)
    index = _assert_same(tmp_path / "model.gguf")
    assert index.fields["general.architecture"].contents() == "qwen2"


def test_the_demo_model_when_it_is_here():
    from pathlib import Path

    files = sorted(Path(__file__).resolve().parents[1].glob("models/*/*.gguf"))
    if not files:
        pytest.skip("no GGUF under models/ (make serve or tests/test_real_model.py fetch one)")
    _assert_same(files[0])


def test_broken_files_fail_naming_the_problem(tiny_qwen2, tmp_path):
    good = tmp_path / "model.gguf"
    write_gguf(tiny_qwen2, good, Q.F32)
    data = bytearray(good.read_bytes())
    cases = {
        "not a GGUF file": b"XXXX" + data[4:],
        "GGUF version 7 is not supported": data[:4] + struct.pack("<I", 7) + data[8:],
        "runs past the end of the file": data[:len(data) - 64],
    }
    for message, content in cases.items():
        path = tmp_path / "broken.gguf"
        path.write_bytes(content)
        with pytest.raises(ValueError, match=message):
            GGUFIndex(path)


def test_the_benchmark_times_both_readers(tiny_qwen2, tmp_path, capsys):
    from loadtest import gguf_index_bench

    write_gguf(tiny_qwen2, tmp_path / "model.gguf", Q.Q8_0)
    report = gguf_index_bench.main(["--model", str(tmp_path), "--repeats", "1", "--out", str(tmp_path / "r.json")])
    assert report["gguf_reader_s"] > 0 and report["gguf_index_s"] > 0 and report["file"] == "model.gguf"
    assert "engine GGUFIndex" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        gguf_index_bench.main(["--model", str(tmp_path / "nothing"), "--out", str(tmp_path / "r.json")])
