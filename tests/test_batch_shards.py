"""serve_app.batch.shards: whole shards only, named by their ids, and the ids they hold."""
import pyarrow as pa
import pytest

from serve_app.batch import shards


def _table(ids):
    return pa.table({"id": ids, "text": [f"t{i}" for i in ids]})


@pytest.mark.parametrize("fmt", shards.FORMATS)
def test_shards_round_trip_and_ids_are_done(tmp_path, fmt):
    out = str(tmp_path / "out")
    shards.write_shard(out, _table([0, 1]), fmt)
    shards.write_shard(out, _table([2]), fmt)
    assert len(shards.list_shards(out)) == 2
    assert sorted(r["id"] for r in shards.read_rows(out)) == [0, 1, 2]
    assert shards.done_ids(out) == {0, 1, 2}


def test_a_rewritten_batch_replaces_its_own_shard(tmp_path):
    out = str(tmp_path / "out")
    first = shards.write_shard(out, _table([5, 6]), "jsonl")
    again = shards.write_shard(out, _table([5, 6]), "jsonl")  # a batch Ray re-ran
    assert first == again and len(shards.list_shards(out)) == 1
    assert len(shards.read_rows(out)) == 2


def test_temporaries_of_a_killed_job_are_not_shards(tmp_path):
    out = tmp_path / "out"
    shards.write_shard(str(out), _table([1]), "jsonl")
    (out / ".part-0123.jsonl.99.tmp").write_text('{"id": 2, "te')  # torn: the writer was killed
    assert shards.done_ids(str(out)) == {1}
    assert shards.remove_temporaries(str(out)) == 1
    assert sorted(p.name for p in out.iterdir()) == [p.rsplit("/", 1)[-1] for p in shards.list_shards(str(out))]


def test_missing_output_directory_is_empty(tmp_path):
    assert shards.list_shards(str(tmp_path / "none")) == [] and shards.done_ids(str(tmp_path / "none")) == set()
