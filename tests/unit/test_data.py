"""Loading text sources, the stream of rows, fingerprints and dataset folders."""

import json
from pathlib import Path

import pytest
from datasets import load_from_disk
from transformers import AutoTokenizer

from neuron_parallel.data import tokenize_dataset


def test_stream_concatenates_documents_with_eos_as_before(tiny_world, tmp_path):
    """Format text with packing unset is the stream: rows of block_size + 1 tokens of the
    concatenated documents, stored as inputs row[:-1] and labels row[1:], no position_ids."""
    docs = ["alpha beta gamma " * 5, "delta epsilon", "zeta eta theta iota " * 7]
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    ds = tokenize_dataset(source=str(src), tokenizer_dir=tiny_world["model"], block_size=8, cache_dir=tmp_path / "c")
    tok = AutoTokenizer.from_pretrained(tiny_world["model"])
    stream = [t for d in docs for t in tok(d, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]]
    rows = load_from_disk(ds.path)
    assert rows.column_names == ["input_ids", "labels"] and ds.attention == "causal" and ds.eval_path is None
    assert rows.features["input_ids"].feature.dtype == rows.features["labels"].feature.dtype == "int32"
    inputs, labels = rows["input_ids"], rows["labels"]
    assert ds.num_tokens == len(stream)
    assert ds.num_blocks == len(stream) // 9 == len(rows)
    assert [int(t) for x, y in zip(inputs, labels) for t in list(x) + [y[-1]]] == stream[: 9 * len(rows)]
    assert all(list(x[1:]) == list(y[:-1]) for x, y in zip(inputs, labels))
    assert ds.audit["packing"] == "stream" and ds.audit["fill"] == 1.0 and ds.audit["trained_fraction"] == 1.0
    assert ds.audit["sample"]["text"] == tok.decode(inputs[0])[:500] and ds.audit["sample"]["masked_spans"] == []


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


def _hub_like_folder(root):
    """A local folder laid out like the Hub's wikitext: two configs declared in README metadata."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = {
        ("wikitext-2-raw-v1", "train"): [" = Valkyria Chronicles = \n", " The game began development in 2010 .\n"] * 8,
        ("wikitext-2-raw-v1", "validation"): [" = Homarus gammarus = \n"] * 4,
        ("wikitext-103-raw-v1", "train"): [" = Robert Boulter = \n", " He is an English actor .\n"] * 30,
    }
    for (name, split), rows in texts.items():
        (root / name).mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({"text": rows}), root / name / f"{split}-00000-of-00001.parquet")
    (root / "README.md").write_text(
        "---\nconfigs:\n"
        "- config_name: wikitext-103-raw-v1\n  data_files:\n  - split: train\n    path: wikitext-103-raw-v1/train-*\n"
        "- config_name: wikitext-2-raw-v1\n  data_files:\n  - split: train\n    path: wikitext-2-raw-v1/train-*\n"
        "  - split: validation\n    path: wikitext-2-raw-v1/validation-*\n---\n# wikitext\n"
    )
    return texts


def test_dataset_folder_with_configs_reads_the_named_config_and_split(tiny_world, tmp_path):
    folder = tmp_path / "wikitext"
    texts = _hub_like_folder(folder)
    kw = dict(source=str(folder), tokenizer_dir=tiny_world["model"], block_size=8, cache_dir=tmp_path / "c")
    small = tokenize_dataset(config="wikitext-2-raw-v1", **kw)
    valid = tokenize_dataset(config="wikitext-2-raw-v1", split="validation", **kw)
    large = tokenize_dataset(config="wikitext-103-raw-v1", **kw)
    tok = AutoTokenizer.from_pretrained(tiny_world["model"])

    def count(rows):
        return sum(len(tok(r, add_special_tokens=False)["input_ids"]) + 1 for r in rows)

    assert small.num_tokens == count(texts[("wikitext-2-raw-v1", "train")])
    assert valid.num_tokens == count(texts[("wikitext-2-raw-v1", "validation")])
    assert large.num_tokens == count(texts[("wikitext-103-raw-v1", "train")])
    assert len({small.fingerprint, valid.fingerprint, large.fingerprint}) == 3


def test_dataset_folder_refusals_name_the_configs_and_splits(tiny_world, tmp_path):
    folder = tmp_path / "wikitext"
    _hub_like_folder(folder)
    kw = dict(source=str(folder), tokenizer_dir=tiny_world["model"], block_size=8, cache_dir=tmp_path / "c")
    names = r"\['wikitext-103-raw-v1', 'wikitext-2-raw-v1'\]"
    with pytest.raises(ValueError, match=rf"has no config 'wikitext-2-v1'; set data.config to one of {names}"):
        tokenize_dataset(config="wikitext-2-v1", **kw)
    with pytest.raises(ValueError, match=rf"has several configs; set data.config to one of {names}"):
        tokenize_dataset(**kw)
    with pytest.raises(ValueError, match=r"data.split: Unknown split \"test\".*\['train', 'validation'\]"):
        tokenize_dataset(config="wikitext-2-raw-v1", split="test", **kw)
    with pytest.raises(ValueError, match="data.config='wikitext-2-raw-v1' names a configuration of a dataset"):
        tokenize_dataset(
            source=tiny_world["corpus"],
            tokenizer_dir=tiny_world["model"],
            block_size=8,
            cache_dir=tmp_path,
            config="wikitext-2-raw-v1",
        )
    assert not (tmp_path / "c").exists() or not any((tmp_path / "c").iterdir())  # nothing written when refused


def test_fingerprint_covers_every_setting_and_the_template_and_tokenizer_content(tiny_world, tmp_path):
    import shutil

    from neuron_parallel.config import DataConfig
    from neuron_parallel.data import dataset_fingerprint

    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    base = dict(source=tiny_world["chat"], format="chat", chat_template=str(template))

    def fp(tokenizer=tiny_world["model"], **kw):
        return dataset_fingerprint(DataConfig(**{**base, **kw}), tokenizer)

    first = fp()
    changed = [
        fp(train_on_prompt=True),
        fp(packing=False),
        fp(seed=1),
        fp(eval_fraction=0.1),
        fp(eval_source=tiny_world["corpus"]),
        fp(messages_field="conversation"),
        fp(block_size=64),
        fp(source=[tiny_world["chat"], tiny_world["corpus"]], weights=[1.0, 1.0]),
        fp(source=[tiny_world["chat"], tiny_world["corpus"]], weights=[2.0, 1.0]),
    ]
    assert len({first, *changed}) == len(changed) + 1
    assert fp(cache_dir=str(tmp_path / "elsewhere")) == first
    same = tmp_path / "same.jinja"
    same.write_text(template.read_text())
    assert fp(chat_template=str(same)) == first  # the template's content counts, not its path
    template.write_text(template.read_text() + "\n")
    assert fp() != first
    tokenizer = tmp_path / "tokenizer"
    shutil.copytree(tiny_world["model"], tokenizer)
    before = fp(tokenizer)
    (tokenizer / "chat_template.jinja").write_text("{{ messages }}")
    assert fp(tokenizer) != before


def test_a_tokenized_dataset_pickles_and_reloads_equal(tiny_world, tmp_path):
    import pickle

    kw = dict(source=tiny_world["chat"], tokenizer_dir=tiny_world["qwen2"], block_size=128, cache_dir=tmp_path)
    ds = tokenize_dataset(format="chat", eval_fraction=0.1, **kw)
    assert pickle.loads(pickle.dumps(ds)) == ds == tokenize_dataset(format="chat", eval_fraction=0.1, **kw)
    assert json.loads((tmp_path / ds.fingerprint / "neuron_flows_dataset.json").read_text())["audit"] == ds.audit
    assert ds.path.endswith("/train") and ds.eval_path.endswith("/eval") and ds.attention == "document"


@pytest.mark.parametrize("fmt", ["chat", "preference", "text"])
def test_rows_do_not_depend_on_where_they_are_built(tiny_world, tmp_path, monkeypatch, fmt):
    """Train and eval rows and the audit are the same bit for bit whether a small source is
    encoded in this process into memory and packed there, encoded by a pool of two worker
    processes through ``datasets.map`` (cache files, packed by ``datasets.map``), or encoded into
    memory and packed by ``datasets.map`` (rows over ``ROWS_IN_MEMORY_BYTES``). num_proc=1 starts
    no pool; unset, a pool encodes a source of POOL_MIN_BYTES or more from POOL_MIN_CORES cores on,
    and any source of IN_MEMORY_MAX_BYTES or more."""
    from neuron_parallel import data
    from neuron_parallel.data import _encode_procs
    from neuron_parallel.sources import IN_MEMORY_MAX_BYTES, POOL_MIN_BYTES, POOL_MIN_CORES
    from neuron_parallel.tiny import TEMPLATES

    assert _encode_procs(1, POOL_MIN_BYTES) is None and _encode_procs(3, 0) == 3
    cores = data.usable_cores
    for n, pool in ((1, None), (2, None), (POOL_MIN_CORES - 1, None), (POOL_MIN_CORES, POOL_MIN_CORES), (16, 8)):
        monkeypatch.setattr(data, "usable_cores", lambda n=n: n)
        assert _encode_procs(None, POOL_MIN_BYTES - 1) is None
        assert _encode_procs(None, POOL_MIN_BYTES) == pool
        assert _encode_procs(None, IN_MEMORY_MAX_BYTES) == (min(n, 8) if n > 1 else None)
    monkeypatch.setattr(data, "usable_cores", cores)
    here = []
    encoded_here = data._encoded_here
    monkeypatch.setattr(data, "_encoded_here", lambda *a: here.append(a) or encoded_here(*a))
    kw = dict(
        source=tiny_world["corpus" if fmt == "text" else fmt],
        tokenizer_dir=tiny_world["model"],
        block_size=128,
        format=fmt,
        eval_fraction=0.2,
        chat_template=None if fmt == "text" else str(TEMPLATES / "llama3.jinja"),
    )
    one = tokenize_dataset(cache_dir=tmp_path / "one", **kw)
    assert len(here) == 1
    two = tokenize_dataset(cache_dir=tmp_path / "two", num_proc=2, **kw)
    assert len(here) == 1
    monkeypatch.setattr(data, "ROWS_IN_MEMORY_BYTES", 0)
    three = tokenize_dataset(cache_dir=tmp_path / "three", **kw)
    assert len(here) == 2
    assert one.num_blocks > 1 and one.num_eval_blocks > 0 and one.audit == two.audit == three.audit
    for other in (two, three):
        for mine, theirs in ((one.path, other.path), (one.eval_path, other.eval_path)):
            a, b = load_from_disk(mine).with_format("numpy")[:], load_from_disk(theirs).with_format("numpy")[:]
            assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


def test_json_lines_read_by_pyarrow_equal_what_load_dataset_reads(tmp_path):
    """Small local JSON Lines files are read by pyarrow without ``load_dataset``: the same columns,
    types and rows (nested messages, a field missing from some rows, several files), in memory (no
    file written), named by the files' contents; files pyarrow refuses (a JSON array, a field whose
    type changes) are read by ``load_dataset`` as before, into its cache."""
    from datasets import load_dataset

    from neuron_parallel.sources import load_raw

    rows = [
        {"messages": [{"role": "user", "content": "hi é"}, {"role": "assistant", "content": "yo"}], "id": 1},
        {"messages": [{"role": "system", "content": "s"}], "id": 2, "extra": "d"},
        {"messages": [{"role": "assistant", "content": "z"}], "id": 3, "extra": "e"},
    ]
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    first.write_text("".join(json.dumps(r) + "\n" for r in rows[:2]))
    second.write_text(json.dumps(rows[2]) + "\n")
    files = [str(first), str(second)]
    got = load_raw(files, "train")
    want = load_dataset("json", data_files=files, split="train")
    assert got.features == want.features and got[:] == want[:] and len(got) == 3
    assert got.cache_files == [] and load_raw(files, "train")._fingerprint == got._fingerprint
    one = load_raw(str(first), "train")  # one file: read where it lies
    assert one.cache_files == [] and one[:] == load_dataset("json", data_files=str(first), split="train")[:]
    second.write_text(json.dumps({**rows[2], "id": 4}) + "\n")
    assert load_raw(files, "train")._fingerprint != got._fingerprint

    mixed = tmp_path / "mixed.jsonl"  # "v" is a number, then a string
    mixed.write_text('{"v": 1}\n{"v": "one"}\n')
    array = tmp_path / "array.json"  # a JSON array, not JSON Lines
    array.write_text(json.dumps([{"text": "a"}, {"text": "b"}]))
    for path in (mixed, array):
        got = load_raw(str(path), "train")
        assert got[:] == load_dataset("json", data_files=str(path), split="train")[:]
        assert got.cache_files  # load_dataset's


def test_chat_rows_do_not_depend_on_the_json_reader(tiny_world, tmp_path, monkeypatch):
    """Messages with a field only some of them carry are a struct to pyarrow (None where absent)
    and JSON to ``load_dataset``: the tokenized rows and audit are the same either way."""
    import neuron_parallel.sources as sources_module

    lines = Path(tiny_world["chat"]).read_text().splitlines()
    named = json.loads(lines[0])
    named["messages"][0]["name"] = "ops"
    src = tmp_path / "chat.jsonl"
    src.write_text("\n".join([json.dumps(named), *lines[1:40]]) + "\n")
    kw = dict(source=str(src), tokenizer_dir=tiny_world["model"], block_size=64, format="chat")
    kw["chat_template"] = str(Path(tiny_world["chat_templates"]) / "llama3.jinja")
    fast = tokenize_dataset(cache_dir=tmp_path / "fast", **kw)
    assert "name" in sources_module.load_raw(str(src), "train").features["messages"].feature  # a struct, from pyarrow
    monkeypatch.setattr(sources_module, "_json_lines", lambda files: None)
    slow = tokenize_dataset(cache_dir=tmp_path / "slow", **kw)
    assert load_from_disk(fast.path).with_format(None)[:] == load_from_disk(slow.path).with_format(None)[:]
    assert fast.audit == slow.audit and fast.num_tokens == slow.num_tokens > 0


def test_numpy_huge_page_advice_is_off_while_tokenizing_and_restored_after(tiny_world, tmp_path, monkeypatch):
    """``tokenize_data`` packs with NumPy's huge-page advice off (``utils.small_pages``) and leaves
    it as it found it, after a result and after a refusal."""
    from numpy._core.multiarray import _set_madvise_hugepage

    from neuron_parallel import data
    from neuron_parallel.tiny import TEMPLATES

    def advice() -> bool:
        was = _set_madvise_hugepage(False)
        _set_madvise_hugepage(was)
        return was

    seen = []
    pack = data.document_rows
    monkeypatch.setattr(data, "document_rows", lambda *a, **k: seen.append(advice()) or pack(*a, **k))
    kw = dict(
        tokenizer_dir=tiny_world["model"], block_size=64, format="chat", chat_template=str(TEMPLATES / "llama3.jinja")
    )
    initial = _set_madvise_hugepage(True)
    try:
        tokenize_dataset(source=tiny_world["chat"], cache_dir=tmp_path / "a", **kw)
        assert seen and not any(seen) and advice() is True
        _set_madvise_hugepage(False)
        bad = tmp_path / "bad.jsonl"
        bad.write_text(json.dumps({"messages": [{"role": "narrator", "content": "x"}]}) + "\n")
        with pytest.raises(ValueError, match="narrator"):
            tokenize_dataset(source=str(bad), cache_dir=tmp_path / "b", **kw)
        assert advice() is False
    finally:
        _set_madvise_hugepage(initial)
