"""``data.save_rows`` writes what ``Dataset.save_to_disk`` writes: rows in memory as shards written
at once on threads, with the same state and info files (but for the list of shards), read back by
``load_from_disk`` as the same rows, features, format and fingerprint; rows it does not shard go
to ``save_to_disk`` itself."""

from __future__ import annotations

import json

import numpy as np
import pytest
from datasets import Dataset, Features, List, Value, load_from_disk
from datasets.info import DatasetInfo
from datasets.table import InMemoryTable

from neuron_parallel import data


def _rows(count: int, block: int = 16, chunks: int = 1) -> Dataset:
    import pyarrow as pa

    rng = np.random.default_rng(count)
    row = List(Value("int32"), length=block)
    features = Features({"input_ids": row, "labels": row, "_kept": Value("int64")})
    cols = {
        name: pa.FixedSizeListArray.from_arrays(pa.array(rng.integers(0, 999, count * block, dtype=np.int32)), block)
        for name in ("input_ids", "labels")
    }
    table = pa.table({**cols, "_kept": pa.array(np.arange(count))})
    cuts = [count * k // chunks for k in range(chunks + 1)]  # as rows packed in batches arrive: in chunks
    table = pa.concat_tables([table.slice(a, b - a) for a, b in zip(cuts, cuts[1:])])
    rows = Dataset(InMemoryTable(table), DatasetInfo(features=features), fingerprint=f"rows{count}")
    return rows.with_format("numpy")


def _files(path) -> tuple[dict, dict]:
    return json.loads((path / "state.json").read_text()), json.loads((path / "dataset_info.json").read_text())


@pytest.mark.parametrize("cores,chunks", [(2, 1), (3, 1), (8, 1), (2, 3), (3, 4)])
def test_rows_saved_in_shards_read_back_as_save_to_disk_writes_them(tmp_path, monkeypatch, cores, chunks):
    monkeypatch.setattr(data, "SAVE_MIN_BYTES", 1)
    monkeypatch.setattr(data, "usable_cores", lambda: cores)
    rows = _rows(101, chunks=chunks)
    assert rows.data.table.column(0).num_chunks == chunks
    data.save_rows(rows, tmp_path / "ours")
    rows.save_to_disk(str(tmp_path / "theirs"))
    ours, theirs = _files(tmp_path / "ours"), _files(tmp_path / "theirs")
    shards = min(cores, 4)
    assert [f["filename"] for f in ours[0].pop("_data_files")] == [
        f"data-{k:05d}-of-{shards:05d}.arrow" for k in range(shards)
    ]
    theirs[0].pop("_data_files")
    assert ours == theirs  # state (fingerprint, format) and info (features) as save_to_disk writes them
    back, want = load_from_disk(str(tmp_path / "ours")), load_from_disk(str(tmp_path / "theirs"))
    assert back.features == want.features and back.format == want.format and back._fingerprint == want._fingerprint
    assert back.data.table.equals(want.data.table)


def test_rows_it_does_not_shard_are_saved_by_save_to_disk(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "SAVE_MIN_BYTES", 1)
    picked = _rows(40).select(range(0, 40, 3))  # an indices mapping: save_to_disk applies it
    data.save_rows(picked, tmp_path / "picked")
    back = load_from_disk(str(tmp_path / "picked"))
    assert len(back) == 14 and list(back["_kept"]) == list(range(0, 40, 3))
    monkeypatch.setattr(data, "usable_cores", lambda: 1)  # one core: one file
    data.save_rows(_rows(30), tmp_path / "one")
    assert [f["filename"] for f in _files(tmp_path / "one")[0]["_data_files"]] == ["data-00000-of-00001.arrow"]
