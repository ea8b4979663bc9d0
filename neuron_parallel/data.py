"""Loading, tokenizing, packing and caching the training data: what the tokenize step hands to
training.

``tokenize_data`` reads every source (``datasets``; a local JSON Lines source encoded here with
pyarrow alone, ``neuron_parallel.sources``), renders and masks each example (``neuron_parallel.sft``),
mixes weighted sources, holds out or reads the evaluation examples, builds rows
(``neuron_parallel.packing``) and saves them under ``cache_dir/<fingerprint>/``. A source that
``sources.encodes_here`` (on fewer than five cores, up to 256 MB; on more, under 16 MB) is encoded
and packed in this process, in memory, so the saved rows are the only file written
(``_encoded_here``); another goes through ``datasets.map``, in a pool of processes, with its cache
files:

- ``train/`` and, when evaluation is configured, ``eval/``: ``datasets`` folders (numpy format)
  with int32 columns ``input_ids``, ``labels`` (shifted targets, -100 without loss) and, in
  document mode only, ``position_ids``, each of ``block_size`` tokens per row;
- ``neuron_flows_dataset.json``: the ``TokenizedDataset``; ``audit.json``: its audit, with the
  ``lineage`` of every source (a Hub dataset's repo id and commit, a local one's name and content
  fingerprint) and of the rows (``fingerprint``).

A Hub dataset is read at the commit its revision resolves to (``checks.resolve_hub_repo``), from
a snapshot of that repo at that commit in the Hugging Face cache, never from a copy ``datasets``
prepared under the same name (which may come from a local folder of that name). An existing
complete result is reused; a new one is written under a private name and renamed into place.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import shutil
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from .audit import build_audit
from .checkpoint.format import TOKENIZER_FILES
from .checks import HubRevision, hub_name, hub_sources, resolve_hub_repo
from .config import DataConfig
from .packing import PACK_BATCH, count_columns, document_rows, stream_rows
from .pairs import PairEncoder, pair_columns, pair_features, pair_rows
from .sft import Encoder, resolve_columns
from .sources import dataset_repo, encodes_here, hub_dataset_dir, load_raw, local_data_files
from .utils import sha256_file, small_pages, usable_cores

FORMAT_VERSION = 2
INFO_FILE = "neuron_flows_dataset.json"
AUDIT_FILE = "audit.json"


@dataclass(frozen=True, slots=True)
class TokenizedDataset:
    """A tokenized dataset on disk: what the tokenize step hands to training."""

    path: str
    """The training rows (``<cache_dir>/<fingerprint>/train``)."""
    fingerprint: str
    """Digest of everything that determines the rows (``dataset_fingerprint``)."""
    num_tokens: int
    """Stream: every token of the training documents; documents: the real tokens in the rows."""
    num_blocks: int
    """Training rows."""
    block_size: int
    """Tokens per row."""
    attention: str = "causal"
    """causal (the stream: plain causal attention across a row) or document (attention and
    ``position_ids`` restart at every document)."""
    eval_path: str | None = None
    """The evaluation rows, when evaluation is configured."""
    num_eval_blocks: int = 0
    """Evaluation rows."""
    audit: dict = field(default_factory=dict, hash=False)
    """What was made of the data (``audit_table`` lists it); JSON-serialisable."""


def _source_entries(data: DataConfig) -> list[tuple[str | list[str], str]]:
    """The training sources with the name refusals use: each entry of a weighted list, else the
    whole ``data.source`` (one file, folder, list of files, dataset folder or Hub id)."""
    if data.weights is not None:
        return [(s, f"data.source[{i}]") for i, s in enumerate(data.source)]
    return [(data.source, "data.source")]


def _hash_source(h, source: str | list[str], commit: str | None = None) -> None:
    repo = dataset_repo(source)
    if repo is None:
        files = local_data_files(source)
    elif Path(repo).expanduser().is_dir():  # a local dataset folder: every file in it counts
        files = sorted(p for p in Path(repo).expanduser().rglob("*") if p.is_file() and ".git" not in p.parts)
    else:
        files = None
    if files is None:
        h.update(f"hub:{source}".encode() + (f"@{commit}".encode() if commit else b""))
    else:
        h.update(f"files:{len(files)}".encode())
        for f in files:
            h.update(sha256_file(f).encode())


def dataset_fingerprint(data: DataConfig, tokenizer_dir: str | Path, commits: dict[str, str] | None = None) -> str:
    """A digest of everything that determines the rows: every setting of ``data`` but where
    things are kept, the contents of every source and evaluation source (or their Hub names at
    the commits ``commits`` gives by config key, ``_hub_revisions``) and of the chat template
    file, the tokenizer's files, and this format's version."""
    commits = commits or {}
    h = hashlib.sha256()
    paths = ("source", "eval_source", "cache_dir", "chat_template", "revision")  # counted by content below
    settings = {k: v for k, v in dataclasses.asdict(data).items() if k not in paths}
    h.update(json.dumps([FORMAT_VERSION, settings], sort_keys=True).encode())
    for source, key in _source_entries(data):
        _hash_source(h, source, commits.get(key))
    if data.eval_source is not None:
        h.update(b"eval")
        _hash_source(h, data.eval_source, commits.get("data.eval_source"))
    if data.chat_template is not None:
        h.update(b"template" + sha256_file(Path(data.chat_template).expanduser()).encode())
    for name in TOKENIZER_FILES:
        p = Path(tokenizer_dir) / name
        if p.exists():
            h.update(name.encode() + sha256_file(p).encode())
    return h.hexdigest()[:20]


def _hub_revisions(data: DataConfig) -> dict[str, HubRevision]:
    """The commit of every Hub dataset ``data`` reads, by config key (``checks.hub_sources``); an
    evaluation source that is one of the training sources is read at that source's commit."""
    found = {
        key: resolve_hub_repo(key, repo_id, revision, repo_type="dataset", revision_key=revision_key)
        for key, repo_id, revision, revision_key in hub_sources(data)
    }
    eval_name = hub_name(data.eval_source) if data.eval_source is not None else None
    if eval_name is not None and "data.eval_source" not in found:
        found["data.eval_source"] = next(rev for rev in found.values() if rev.repo_id == eval_name)
    return found


def _encoded_features(data: DataConfig):
    """``ids``, and for formats that mask, ``trained`` (text trains every token: no column)."""
    from datasets import Features, List, Value

    if data.format == "preference":
        return pair_features()
    trained = {"trained": List(Value("int8"))} if data.format != "text" else {}
    return Features({"ids": List(Value("int32")), **trained})


def _encode_procs(num_proc: int | None, num_bytes: int) -> int | None:
    """Processes for encoding: ``num_proc`` when given (1: none, the calling process; datasets
    would start a pool of one); else none for a source ``sources.encodes_here`` and one per core
    (up to 8) for the others. Encoding is per example, so the rows do not depend on it; packing
    always runs in one process, because its batch edges decide where rows are cut."""
    if num_proc is not None:
        return num_proc if num_proc > 1 else None
    cores = usable_cores()
    return None if cores == 1 or encodes_here(num_bytes, cores) else min(cores, 8)


def _stage_fingerprint(fingerprint: str, *stage: str) -> str:
    """The ``datasets`` fingerprint of a dataset built in memory here: one per data fingerprint and
    stage (``datasets`` would otherwise hash the whole table to make one)."""
    return hashlib.sha256("\0".join((fingerprint, *stage)).encode()).hexdigest()[:16]


def _in_memory(table, features, fingerprint: str):
    """``table`` (cast to ``features``) as an in-memory ``Dataset``."""
    from datasets import Dataset, DatasetInfo
    from datasets.table import InMemoryTable

    return Dataset(
        InMemoryTable(table.cast(features.arrow_schema)), DatasetInfo(features=features), fingerprint=fingerprint
    )


def _encoded_here(data: DataConfig, raw, encoder, fingerprint: str):
    """The examples of a source ``sources.encodes_here``, encoded in this process into memory: the
    whole source is one batch of the encoder (``encode_dataset``), whose pieces keep the
    tokenizer busy from the first to the last (``token_starts.overlapped``). ``datasets.map`` would
    cut it into batches of 1,000, with the tokenizer idle between them, and write the examples to a
    cache file that the packing reads back; on the tokenization benchmark's 2-core host, writing
    files took 0.01 to 0.4 s per 46 MB from one run to the next, while a copy in memory took 0.01 s."""
    features = _encoded_features(data)
    if len(raw) == 0:
        return _in_memory(features.arrow_schema.empty_table(), features, fingerprint)
    return _in_memory(encoder.encode_dataset(raw.with_format(None)), features, fingerprint)


def _examples(
    data: DataConfig,
    tokenizer,
    sources,
    split: str,
    num_proc: int | None,
    hub_dirs: dict[str, Path],
    fingerprint: str,
):
    """Every source's examples as ``ids`` and ``trained`` lists, weighted sources interleaved;
    ``hub_dirs``: the snapshot of each Hub dataset source, by config key. A source encoded in this
    process (``sources.encodes_here``) is kept in memory (:func:`_encoded_here`), another goes
    through ``datasets.map`` (a pool where ``_encode_procs`` says)."""
    from datasets import interleave_datasets

    parts = []
    for source, name in sources:
        if split != data.split and dataset_repo(source) is None:
            raise ValueError(
                f"data.eval_split={split!r} names a split of a Hub dataset or dataset folder, but {name} {source!r} "
                "is plain data files (one split); drop data.eval_split and point data.eval_source at the evaluation "
                "file(s), or hold examples out with data.eval_fraction"
            )
        raw = load_raw(source, split, data.config, hub_dirs.get(name))
        where = f"{name} {source!r}"
        if data.format == "preference":
            encoder = PairEncoder(data, tokenizer, pair_columns(data, raw.column_names, where), name)
        else:
            encoder = Encoder(data, tokenizer, resolve_columns(data, raw.column_names, where), name)
        procs = _encode_procs(num_proc, raw.data.nbytes)
        if procs is None and encodes_here(raw.data.nbytes, usable_cores()):
            parts.append(_encoded_here(data, raw, encoder, _stage_fingerprint(fingerprint, "examples", name, split)))
            continue
        parts.append(
            raw.map(
                encoder,
                batched=True,
                with_indices=True,
                remove_columns=raw.column_names,
                features=_encoded_features(data),
                num_proc=procs,
                load_from_cache_file=False,  # the rows are cached by fingerprint; no stale partial results
                desc=f"tokenize {name}",
            )
        )
    if len(parts) == 1:
        return parts[0]
    total = sum(data.weights)
    return interleave_datasets(
        parts, probabilities=[w / total for w in data.weights], seed=data.seed, stopping_strategy="first_exhausted"
    )


def _split_examples(data: DataConfig, tokenizer, num_proc: int | None, hub_dirs: dict[str, Path], fingerprint: str):
    """``(training examples, evaluation examples or None)``: the evaluation ones read from
    ``eval_source``/``eval_split``, or held out of the training examples by ``data.seed``."""
    sources = _source_entries(data)
    examples = _examples(data, tokenizer, sources, data.split, num_proc, hub_dirs, fingerprint)
    if data.eval_fraction:
        n = len(examples)
        if n < 2 or math.ceil(n * data.eval_fraction) >= n:
            raise ValueError(
                f"data.eval_fraction={data.eval_fraction} of {n} examples leaves no training or no evaluation "
                "example; use a smaller fraction, more data, or data.eval_source"
            )
        parts = examples.train_test_split(test_size=data.eval_fraction, seed=data.seed, load_from_cache_file=False)
        return parts["train"], parts["test"]
    if not data.has_eval:
        return examples, None
    eval_sources = sources if data.eval_source is None else [(data.eval_source, "data.eval_source")]
    split = data.eval_split or data.split
    return examples, _examples(data, tokenizer, eval_sources, split, num_proc, hub_dirs, fingerprint)


ROWS_IN_MEMORY_BYTES = 1 << 30
"""Most bytes of rows, by :func:`_rows_bound`, that are built in memory from examples in memory."""


def _rows_bound(data: DataConfig, examples) -> int:
    """Bytes of the rows of ``examples`` at most: every example alone in a row, plus a row for every
    ``block_size`` of their values (a document cut into pieces, the stream), four int32 columns."""
    return (len(examples) + examples.data.nbytes // 4 // data.block_size + 1) * data.block_size * 16


def _rows(data: DataConfig, examples, pad_id: int, fingerprint: str):
    """The rows of ``examples`` (``neuron_parallel.packing``) and the sums of their counts. From
    examples in memory (a small source, :func:`_encoded_here`) they are built in memory too, up to
    ``ROWS_IN_MEMORY_BYTES``: ``datasets.map`` would write them to a cache file and saving would
    write them again; else in batches of ``PACK_BATCH`` by ``datasets.map``, batch edges the same."""
    from datasets import Features, List, Value

    row = List(Value("int32"), length=data.block_size)
    names = ["input_ids", "labels"] + (["position_ids"] if data.documents else [])
    counts = {name: Value("int64") for name in ("_kept", "_truncated", "_tokens", "_trained")}
    if data.format == "preference":
        names.append("sequence_ids")
        fn = partial(pair_rows, block_size=data.block_size, pad_id=pad_id, one_per_row=data.packing is False)
    elif data.documents:
        split_long = data.format == "text"
        fn = partial(
            document_rows,
            block_size=data.block_size,
            pad_id=pad_id,
            split_long=split_long,
            one_per_row=data.packing is False,
        )
    else:
        fn = partial(stream_rows, block_size=data.block_size)
    features = Features({**{n: row for n in names}, **counts})
    if not examples.cache_files and _rows_bound(data, examples) <= ROWS_IN_MEMORY_BYTES:
        import pyarrow as pa

        batches = examples.with_format("arrow")
        tables = [fn(batches[a : a + PACK_BATCH]) for a in range(0, len(examples), PACK_BATCH)]
        table = pa.concat_tables(tables) if tables else features.arrow_schema.empty_table()
        rows = _in_memory(table, features, fingerprint)
    else:
        rows = examples.with_format("arrow").map(
            fn,
            batched=True,
            batch_size=PACK_BATCH,
            remove_columns=examples.column_names,
            features=features,
            load_from_cache_file=False,
            desc="pack",
        )
    totals = count_columns(rows)
    return rows.with_format(None).remove_columns(list(counts)), totals


SAVE_MIN_BYTES = 16 << 20
"""Bytes of rows below which :func:`save_rows` writes one file."""


def save_rows(rows, path: Path) -> None:
    """``rows.save_to_disk(path)``: the same files (Arrow shards, ``state.json``,
    ``dataset_info.json``, which ``load_from_disk`` reads), with rows of at least
    ``SAVE_MIN_BYTES`` in memory written as one shard per core (up to 4), the shards at once on
    threads. ``save_to_disk`` writes its shards one after the other (in processes, with
    ``num_proc``, which would pickle the rows to them); writing is the kernel copying the rows
    into the page cache, with the GIL released, and it is the last step of tokenizing, with every
    other core idle (on the tokenization benchmark's 2-core host, 46 MB took 0.03 to 0.17 s on one
    thread). Rows read from files (``datasets.map``'s cache) or through an indices mapping go to
    ``save_to_disk``."""
    from concurrent.futures import ThreadPoolExecutor

    import pyarrow as pa
    from datasets import config
    from datasets.arrow_writer import ArrowWriter, get_writer_batch_size_from_data_size
    from datasets.utils.py_utils import asdict

    nbytes = rows.data.nbytes
    shards = min(4, usable_cores(), len(rows), nbytes // SAVE_MIN_BYTES)
    if rows.cache_files or rows._indices is not None or shards < 2:
        rows.save_to_disk(str(path))
        return
    path.mkdir(parents=True)
    bounds = [len(rows) * k // shards for k in range(shards + 1)]
    names = [f"data-{k:05d}-of-{shards:05d}.arrow" for k in range(shards)]
    batch = min(config.DEFAULT_MAX_BATCH_SIZE, get_writer_batch_size_from_data_size(len(rows), nbytes))

    def write(k: int) -> None:
        # As save_to_disk writes each of its shards, but a chunk of the rows (a packing batch's)
        # at a time, into a file of pyarrow's own. ArrowWriter first combines a table's chunks into
        # one, and its Python file receives every buffer as a new bytes object: copies of the shard
        # into fresh memory. The 86 MB of rows of the tokenization benchmark's 20 MB preference set
        # (4 chunks) took 1.24 s to save so, 0.35 to 0.40 s this way (one run each).
        with pa.OSFile(str(path / names[k]), "wb") as stream:
            writer = ArrowWriter(features=rows.features, stream=stream, embed_local_files=True)
            try:
                for chunk in rows.data.table.slice(bounds[k], bounds[k + 1] - bounds[k]).to_batches():
                    writer.write_table(pa.Table.from_batches([chunk]), batch)
                writer.finalize()
            finally:
                writer.close()

    with ThreadPoolExecutor(shards - 1, thread_name_prefix="save") as pool:
        done = [pool.submit(write, k) for k in range(1, shards)]
        write(0)
        for future in done:
            future.result()
    # The state and info save_to_disk writes (keys as it writes them, tests/unit/test_data_save.py).
    keys = ("_fingerprint", "_format_columns", "_format_kwargs", "_format_type", "_output_all_columns")
    state = {key: rows.__dict__[key] for key in keys}
    state["_split"] = str(rows.split) if rows.split is not None else None
    state["_data_files"] = [{"filename": name} for name in names]
    (path / config.DATASET_STATE_JSON_FILENAME).write_text(json.dumps(state, indent=2, sort_keys=True))
    info = asdict(rows._info)
    text = json.dumps({key: info[key] for key in sorted(info)}, indent=2)
    (path / config.DATASET_INFO_FILENAME).write_text(text)


def _list_tokens(examples) -> int:
    import pyarrow.compute as pc

    return int(pc.sum(pc.list_value_length(examples.with_format("arrow")[:]["ids"])).as_py() or 0)


def _refuse_empty(data: DataConfig, examples, what: str) -> None:
    if data.documents:
        raise ValueError(
            f"no {what} example has a token to train on ({len(examples)} examples); check data.train_on_prompt, "
            f"the response or assistant column (data.format={data.format}), and that examples fit data.block_size"
        )
    raise ValueError(
        f"the {what} data has {_list_tokens(examples)} tokens, fewer than one block of {data.block_size + 1}; "
        "lower data.block_size or add data"
    )


def tokenize_data(data: DataConfig, tokenizer_dir: str | Path, *, num_proc: int | None = None) -> TokenizedDataset:
    """Tokenize, mask and pack ``data`` with the tokenizer in ``tokenizer_dir`` into
    ``data.cache_dir/<fingerprint>/`` (see the module docstring), reusing an existing result.
    ``num_proc`` processes encode the examples (default: see ``_encode_procs``); packing runs in
    one, so the rows never depend on it. Raises ValueError naming the fault and the fix."""
    hub = _hub_revisions(data)
    fingerprint = dataset_fingerprint(data, tokenizer_dir, {key: rev.commit for key, rev in hub.items()})
    out = Path(data.cache_dir) / fingerprint
    info_path = out / INFO_FILE
    if info_path.exists():
        return TokenizedDataset(**json.loads(info_path.read_text()))
    with small_pages():
        return _tokenize(data, tokenizer_dir, num_proc, hub, fingerprint, out)


def _tokenize(
    data: DataConfig,
    tokenizer_dir: str | Path,
    num_proc: int | None,
    hub: dict[str, HubRevision],
    fingerprint: str,
    out: Path,
) -> TokenizedDataset:
    """:func:`tokenize_data`'s work, for ``data`` not yet in the cache: into ``out``."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tokenizer.model_max_length = 1 << 62  # examples are cut to rows here, so no length limit applies
    if tokenizer.eos_token_id is None:
        raise ValueError(f"the tokenizer in {tokenizer_dir} has no eos_token; packing needs one to end documents")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    hub_dirs = {key: hub_dataset_dir(rev, data.config, key) for key, rev in hub.items()}
    train_ex, eval_ex = _split_examples(data, tokenizer, num_proc, hub_dirs, fingerprint)
    train_rows, totals = _rows(data, train_ex, pad_id, _stage_fingerprint(fingerprint, "rows", "train"))
    if len(train_rows) == 0:
        _refuse_empty(data, train_ex, "training")
    eval_rows = None
    if eval_ex is not None:
        eval_rows, _ = _rows(data, eval_ex, pad_id, _stage_fingerprint(fingerprint, "rows", "eval"))
        if len(eval_rows) == 0:
            _refuse_empty(data, eval_ex, "evaluation")

    audit = build_audit(data, tokenizer, train_ex, train_rows, totals, eval_ex, eval_rows)
    audit["lineage"] = data_lineage(data, hub, fingerprint)
    # A private temporary name, renamed into place: several nodes (or runs) may tokenize the
    # same data into a shared cache at once, and whichever finishes first wins.
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    save_rows(train_rows.with_format("numpy"), tmp / "train")
    if eval_rows is not None:
        save_rows(eval_rows.with_format("numpy"), tmp / "eval")
    info = TokenizedDataset(
        path=str(out / "train"),
        fingerprint=fingerprint,
        num_tokens=totals["tokens"] if data.documents else _list_tokens(train_ex),
        num_blocks=len(train_rows),
        block_size=data.block_size,
        attention="document" if data.documents else "causal",
        eval_path=str(out / "eval") if eval_rows is not None else None,
        num_eval_blocks=audit["eval_rows"],
        audit=audit,
    )
    text = json.dumps(dataclasses.asdict(info), ensure_ascii=False)
    (tmp / INFO_FILE).write_text(text)
    (tmp / AUDIT_FILE).write_text(json.dumps(audit, indent=2, ensure_ascii=False))
    try:
        tmp.rename(out)
    except OSError:
        if not (out / INFO_FILE).exists():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    return TokenizedDataset(**json.loads(text))  # exactly what a later call reads back


def lineage_name(key: str) -> str:
    """A source's config key as a lineage entry's name (``data.source[1]`` → ``source_1``), one
    MLflow takes as part of a param name."""
    return key.removeprefix("data.").replace("[", "_").rstrip("]")


def _source_identity(key: str, source: str | list[str], hub: dict[str, HubRevision]) -> dict:
    """A Hub source's repo id and commit (and why it came from the cache, if it did); a local
    one's file or folder name(s), never its path, and the digest of its contents."""
    if key in hub:
        rev = hub[key]
        return {"key": key, "repo": rev.repo_id, "commit": rev.commit, **({"cached": rev.cached} if rev.cached else {})}
    names = [Path(s).expanduser().resolve().name for s in ([source] if isinstance(source, str) else source)]
    h = hashlib.sha256()
    _hash_source(h, source)
    return {"key": key, "path": names[0] if len(names) == 1 else names, "fingerprint": h.hexdigest()[:20]}


def data_lineage(data: DataConfig, hub: dict[str, HubRevision], fingerprint: str) -> dict:
    """What the rows were made from: each training source and a separate evaluation source
    (``_source_identity``, by ``lineage_name``) and the rows' ``fingerprint``."""
    sources = _source_entries(data)
    if data.eval_source is not None:
        sources.append((data.eval_source, "data.eval_source"))
    return {**{lineage_name(key): _source_identity(key, s, hub) for s, key in sources}, "fingerprint": fingerprint}


def tokenize_dataset(
    *,
    source: str | list[str],
    tokenizer_dir: str | Path,
    block_size: int,
    cache_dir: str | Path,
    num_proc: int | None = None,
    **fields,
) -> TokenizedDataset:
    """``tokenize_data`` with the ``DataConfig`` fields given as keywords (``text_field``,
    ``split``, ``config``, ``format``, ...)."""
    data = DataConfig(source=source, block_size=block_size, cache_dir=str(cache_dir), **fields)
    return tokenize_data(data, tokenizer_dir, num_proc=num_proc)
