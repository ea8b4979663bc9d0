"""Tokenization, packing, fingerprints and the deterministic read order."""

import json

import pytest
from datasets import load_from_disk
from transformers import AutoTokenizer

from neuron_parallel.data import BlockStream, tokenize_dataset


def test_packing_concatenates_documents_with_eos(tiny_world, tmp_path):
    docs = ["alpha beta gamma " * 5, "delta epsilon", "zeta eta theta iota " * 7]
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    ds = tokenize_dataset(source=str(src), tokenizer_dir=tiny_world["model"], block_size=8, cache_dir=tmp_path / "c")
    tok = AutoTokenizer.from_pretrained(tiny_world["model"])
    stream = [t for d in docs for t in tok(d, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]]
    rows = load_from_disk(ds.path)["input_ids"]
    assert ds.num_tokens == len(stream)
    assert ds.num_blocks == len(stream) // 9 == len(rows)
    assert [int(t) for row in rows for t in row] == stream[: 9 * len(rows)]


def test_fingerprint_reuse_and_change(tiny_world, tmp_path):
    kw = dict(source=tiny_world["corpus"], tokenizer_dir=tiny_world["model"], cache_dir=tmp_path)
    a = tokenize_dataset(block_size=64, **kw)
    b = tokenize_dataset(block_size=64, **kw)
    c = tokenize_dataset(block_size=32, **kw)
    assert a == b and a.fingerprint != c.fingerprint
    assert c.num_blocks > a.num_blocks


def test_text_and_parquet_sources(tiny_world, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    text = tmp_path / "a.txt"
    text.write_text("first paragraph of text here.\n\nsecond paragraph, longer than the first one.\n")
    pq.write_table(pa.table({"content": ["one document", "another document entirely"]}), tmp_path / "p.parquet")
    t = tokenize_dataset(source=str(text), tokenizer_dir=tiny_world["model"], block_size=4, cache_dir=tmp_path / "c")
    p = tokenize_dataset(
        source=str(tmp_path / "p.parquet"),
        tokenizer_dir=tiny_world["model"],
        block_size=4,
        cache_dir=tmp_path / "c",
        text_field="content",
    )
    assert t.num_blocks > 0 and p.num_blocks > 0 and t.fingerprint != p.fingerprint


def test_bad_sources_are_named(tiny_world, tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        tokenize_dataset(
            source=str(tmp_path / "nope.jsonl"), tokenizer_dir=tiny_world["model"], block_size=8, cache_dir=tmp_path
        )
    with pytest.raises(ValueError, match="text_field='body' is not a column"):
        tokenize_dataset(
            source=tiny_world["corpus"],
            tokenizer_dir=tiny_world["model"],
            block_size=8,
            cache_dir=tmp_path,
            text_field="body",
        )


def test_block_stream_is_a_seeded_permutation_per_epoch(tiny_dataset):
    s = BlockStream(tiny_dataset.path, seed=3)
    n = s.num_blocks
    first = s.indices(0, n)
    assert sorted(first) == list(range(n))
    assert s.indices(n, n) != first and sorted(s.indices(n, n)) == list(range(n))
    assert BlockStream(tiny_dataset.path, seed=3).indices(5, 7) == first[5:12]
    x, y = s.batch(0, 2)
    assert x.shape == y.shape == (2, tiny_dataset.block_size)
    assert (x[:, 1:] == y[:, :-1]).all()
