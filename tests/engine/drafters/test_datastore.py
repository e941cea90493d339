"""Datastore: Parquet round trip, validation, and the n-gram continuation index."""

from __future__ import annotations

import json
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cosine_ray.engine.drafters.lookup.datastore import (
    FORMAT_VERSION, METADATA_KEY, ContinuationIndex, Datastore, DatastoreMetadata)

SEQS = [[1, 2, 3, 4], [1, 2, 5], [7, 1, 2, 3, 9]]


def make_store(**kwargs) -> Datastore:
    defaults = dict(domain="code", model_name="SmolLM2-135M-Instruct", vocab_size=49152,
                    params={"max_new_tokens": 96, "prompts": "code-24"})
    defaults.update(kwargs)
    return Datastore.from_sequences(SEQS, **defaults)


def test_save_load_round_trip(tmp_path):
    store = make_store(source_ids=["a", "b", "c"])
    path = store.save(tmp_path / "sub" / "code.parquet")
    assert path.is_file()
    assert not list(path.parent.glob("*.tmp"))
    loaded = Datastore.load(path)
    assert loaded.sequences == tuple(tuple(s) for s in SEQS)
    assert loaded.source_ids == ("a", "b", "c")
    assert loaded.metadata == store.metadata
    assert loaded.metadata.params == {"max_new_tokens": 96, "prompts": "code-24"}
    assert loaded.domain == "code" and len(loaded) == 3 and loaded.num_tokens == 12


def test_file_layout(tmp_path):
    path = make_store().save(tmp_path / "code.parquet")
    table = pq.read_table(path)
    assert table.schema.field("token_ids").type == pa.list_(pa.int32())
    assert table.schema.field("source_id").type == pa.string()
    assert table.column("source_id").to_pylist() == ["seq-000000", "seq-000001", "seq-000002"]
    meta = json.loads(table.schema.metadata[METADATA_KEY])
    assert meta["format_version"] == FORMAT_VERSION
    assert meta["model_name"] == "SmolLM2-135M-Instruct" and meta["vocab_size"] == 49152


def test_load_reads_the_file_without_pyarrows_dataset_modules(tmp_path):
    """An engine start loads every domain's datastore: ``pq.read_table`` would import pyarrow's
    dataset and compute modules for it (checked in a fresh interpreter, where nothing else has)."""
    path = make_store().save(tmp_path / "code.parquet")
    code = ("import sys; from cosine_ray.engine.drafters.lookup.datastore import Datastore; "
            f"s = Datastore.load({str(path)!r}); assert len(s) == 3; "
            "print(sorted(m for m in ('pyarrow.dataset', 'pyarrow.compute') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["[]"]


def test_empty_datastore_round_trip(tmp_path):
    store = Datastore.from_sequences([], domain="chat", model_name="m")
    loaded = Datastore.load(store.save(tmp_path / "empty.parquet"))
    assert loaded.sequences == () and len(loaded.continuation_index()) == 0


def test_missing_file_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        Datastore.load(tmp_path / "nope.parquet")


def test_garbage_file_is_a_value_error(tmp_path):
    path = tmp_path / "bad.parquet"
    path.write_bytes(b"this is not parquet at all" * 10)
    with pytest.raises(ValueError, match="not a readable Parquet"):
        Datastore.load(path)


def test_truncated_file_is_a_value_error(tmp_path):
    path = make_store().save(tmp_path / "code.parquet")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError):
        Datastore.load(path)


def test_plain_parquet_is_not_a_datastore(tmp_path):
    path = tmp_path / "plain.parquet"
    pq.write_table(pa.table({"token_ids": [[1, 2]], "source_id": ["x"]}), path)
    with pytest.raises(ValueError, match="not a cosine_ray datastore"):
        Datastore.load(path)


def write_with_metadata(path, metadata: bytes, table: pa.Table | None = None) -> None:
    table = table if table is not None else pa.table({"token_ids": pa.array([[1, 2]], pa.list_(pa.int32())),
                                                      "source_id": ["x"]})
    pq.write_table(table.replace_schema_metadata({METADATA_KEY: metadata}), path)


def test_bad_metadata_is_a_value_error(tmp_path):
    path = tmp_path / "x.parquet"
    write_with_metadata(path, b"{not json")
    with pytest.raises(ValueError, match="metadata is corrupt"):
        Datastore.load(path)
    write_with_metadata(path, json.dumps({"format_version": 99, "domain": "d", "model_name": "m"}).encode())
    with pytest.raises(ValueError, match="format_version"):
        Datastore.load(path)
    write_with_metadata(path, json.dumps({"format_version": FORMAT_VERSION, "domain": "", "model_name": "m"}).encode())
    with pytest.raises(ValueError, match="domain"):
        Datastore.load(path)


def test_wrong_columns_are_a_value_error(tmp_path):
    path = tmp_path / "x.parquet"
    good_meta = DatastoreMetadata(domain="d", model_name="m").to_json().encode()
    write_with_metadata(path, good_meta, pa.table({"token_ids": pa.array([[1, 2]], pa.list_(pa.int32()))}))
    with pytest.raises(ValueError, match="source_id"):
        Datastore.load(path)
    write_with_metadata(path, good_meta, pa.table({"token_ids": ["a b"], "source_id": ["x"]}))
    with pytest.raises(ValueError, match="token_ids"):
        Datastore.load(path)
    write_with_metadata(path, good_meta, pa.table({"token_ids": pa.array([[1], None], pa.list_(pa.int32())),
                                                   "source_id": ["x", "y"]}))
    with pytest.raises(ValueError, match="null"):
        Datastore.load(path)


def test_token_ids_are_validated():
    with pytest.raises(ValueError, match="outside"):
        Datastore.from_sequences([[1, 49152]], domain="d", model_name="m", vocab_size=49152)
    with pytest.raises(ValueError, match="outside"):
        Datastore.from_sequences([[-1]], domain="d", model_name="m")
    with pytest.raises(ValueError, match="not an int"):
        Datastore.from_sequences([[1, None]], domain="d", model_name="m")
    with pytest.raises(ValueError, match="source_ids"):
        Datastore.from_sequences([[1], [2]], domain="d", model_name="m", source_ids=["only-one"])


@pytest.mark.parametrize("kwargs", [
    {"domain": ""}, {"model_name": ""}, {"vocab_size": 0}, {"params": {"x": object()}},
])
def test_metadata_validation(kwargs):
    base = {"domain": "d", "model_name": "m"}
    base.update(kwargs)
    with pytest.raises(ValueError):
        DatastoreMetadata(**base)


def test_continuation_index_counts_and_order():
    index = ContinuationIndex(SEQS, max_n=3)
    assert index.continuations([1, 2]) == (3, ((3, 2), (5, 1)))
    assert index.continuations([2, 3]) == (2, ((4, 1), (9, 1)))  # tie keeps first occurrence
    assert index.continuations([7, 1, 2]) == (1, ((3, 1),))
    assert index.continuations([4]) is None  # last token of a sequence: no continuation
    assert index.continuations([4, 1]) is None  # n-grams never cross sequences
    assert index.lookup([9, 1, 2], 2, min_n=2, max_n=3) == [(3, 2 / 3), (5, 1 / 3)]
    assert index.lookup([7, 1, 2], 1, min_n=2, max_n=3) == [(3, 1.0)]
    assert index.lookup([8, 2], 1, min_n=2, max_n=3) == []
    assert index.lookup([1, 2], 1, min_n=2, max_n=3, smoothing=1.0) == [(3, 0.5)]


def test_continuation_index_rebuilds_for_longer_n():
    store = make_store(index_max_n=2)
    assert store.continuation_index().max_n == 2
    assert store.continuation_index(4).max_n == 4
    assert store.continuation_index(3).max_n == 4  # never shrinks
