"""Where examples come from: a source as ``data.source`` names it (local data files, a local
dataset folder laid out like a Hub dataset, or a Hub dataset read from its snapshot at a resolved
commit) read into a ``datasets.Dataset``. A local JSON Lines source encoded in this process
(:func:`encodes_here`) is read by pyarrow alone, into memory (``_json_lines``)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from .checks import HubRevision, hub_refusal
from .utils import names_local_path, sha256_file, usable_cores

_BUILDERS = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}

POOL_MIN_BYTES = 16 << 20
"""Size of a source's data (its Arrow table, or its JSON Lines files, in bytes) from which, on a
host of ``POOL_MIN_CORES`` or more, encoding starts a pool of processes when ``num_proc`` is not
given (:func:`encodes_here`). In one process the tokenizer already encodes on every core (its own
threads), so a pool shares out only the Python work (rendering, masking, building lists), while
it costs starting the workers, sending them the examples, merging their results, and the
tokenizer's threads (in a forked worker it encodes on one core). Measured on 2 cores, 5 MB of
chat (or of preference pairs) took 0.1 to 0.4 CPU seconds less in one process than in a pool of
two; by those figures a pool repays its cost from about 12 MB where it has the cores."""

POOL_MIN_CORES = 5
"""Cores from which a pool encodes sources of ``POOL_MIN_BYTES`` or more; below, one process does,
up to ``IN_MEMORY_MAX_BYTES``. In one process the Python work runs on one core, beside the
tokenizer's threads: on the tokenization benchmark (2 cores) the main thread took about a quarter
of the CPU time (0.45-0.53 of 2.2-2.4 s for preference pairs, 0.39-0.48 of 1.6-1.8 s for chat), so
one process keeps about four cores busy, no more, while a pool spent 8 to 16 % more CPU time than
one process on the same 20 MB (chat 7.98 against 6.89 s, preference 12.03 against 11.10 s): a pool
is faster from five cores. On 2 cores, at 20 MB, one process met 0.84x (chat) and 0.91x
(preference) of raw ``tokenizers`` encoding, the pool 0.66x and 0.68x."""

IN_MEMORY_MAX_BYTES = 256 << 20
"""The largest source (its Arrow table, or its JSON Lines files, in bytes) encoded in this process
into memory: its table, its examples and their rows are all held at once (rows up to
``data.ROWS_IN_MEMORY_BYTES``). A larger one goes through ``datasets.map`` and its cache files."""


def encodes_here(num_bytes: int, cores: int) -> bool:
    """Whether a source of ``num_bytes`` is read and encoded in this process, into memory, on a host
    of ``cores`` when ``num_proc`` is not given: below ``IN_MEMORY_MAX_BYTES``, on fewer than
    ``POOL_MIN_CORES`` or below ``POOL_MIN_BYTES``."""
    return num_bytes < IN_MEMORY_MAX_BYTES and (cores < POOL_MIN_CORES or num_bytes < POOL_MIN_BYTES)


def dataset_repo(source: str | list[str]) -> str | None:
    """``source`` when ``datasets.load_dataset`` should read it as a dataset repository: a Hub
    dataset name, or a local folder laid out like a Hub dataset (its configs declared in the
    README's metadata); None for plain data files."""
    if not isinstance(source, str):
        return None
    path = Path(source).expanduser()
    if path.is_dir():
        readme = path / "README.md"
        head = readme.read_text(errors="replace").split("\n---", 1)[0] if readme.is_file() else ""
        return source if head.startswith("---") and "\nconfigs:" in head else None
    return None if path.exists() else (source if local_data_files(source) is None else None)


def local_data_files(source: str | list[str]) -> list[Path] | None:
    """The data files named by ``source``, or None when it is a Hub dataset name."""
    items = [source] if isinstance(source, str) else list(source)
    paths = [Path(s).expanduser() for s in items]
    if not all(p.exists() for p in paths):
        missing = [str(p) for p in paths if not p.exists()]
        if isinstance(source, str) and not names_local_path(source):
            return None  # looks like a Hub id such as "org/name"
        raise ValueError(f"data.source: no such file or directory: {', '.join(missing)}")
    files: list[Path] = []
    for p in paths:
        files.extend(sorted(q for q in p.rglob("*") if q.suffix in _BUILDERS) if p.is_dir() else [p])
    if not files:
        raise ValueError(f"data.source {source!r} holds no .txt/.jsonl/.json/.parquet files")
    if all(f.stat().st_size == 0 for f in files):
        raise ValueError(
            f"data.source {source!r} is empty ({len(files)} file(s) of 0 bytes); point it at the data to train on"
        )
    kinds = {_BUILDERS.get(f.suffix) for f in files}
    if None in kinds or len(kinds) != 1:
        raise ValueError(
            f"data.source mixes or has unsupported file types {sorted(f.suffix for f in files)}; "
            f"use one of {sorted(_BUILDERS)}"
        )
    return files


def _config_patterns(readme: str, config: str | None) -> list[str] | None:
    """The files of configuration ``config`` (None: the only or the default one) that the dataset
    card ``readme`` declares in its metadata; None when it declares no configs (every file is data)."""
    import yaml

    if not readme.startswith("---"):
        return None
    meta = yaml.safe_load(readme[3:].split("\n---", 1)[0]) or {}
    configs = meta.get("configs") if isinstance(meta, dict) else None
    if not configs:
        return None
    chosen = [c for c in configs if c.get("config_name", "default") == config] if config else configs
    if config is None and len(configs) > 1:
        chosen = [c for c in configs if c.get("default")]
    patterns: list[str] = []
    for c in chosen:
        files = c.get("data_files", [])
        for item in [files] if isinstance(files, str | dict) else files:
            paths = item.get("path", []) if isinstance(item, dict) else item
            patterns += [paths] if isinstance(paths, str) else list(paths)
    return patterns


def hub_dataset_dir(rev: HubRevision, config: str | None, key: str) -> Path:
    """The snapshot of Hub dataset ``rev`` at its commit in the Hugging Face cache, holding its card
    and the files of configuration ``config``: fetched from the Hub (``HF_ENDPOINT``) if need be, or
    as the cache holds it when ``rev`` came from the cache (offline, or the Hub unreachable).
    Refused (``ValueError`` naming ``key``) when it can be neither fetched nor found."""
    from huggingface_hub import hf_hub_download, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError, RemoteEntryNotFoundError

    # From the cache alone when the Hub is known to be out of reach: no retries against it.
    where = {"repo_type": "dataset", "revision": rev.commit, "local_files_only": rev.cached is not None}
    try:
        readme = Path(hf_hub_download(rev.repo_id, "README.md", **where))
        files = _config_patterns(readme.read_text(errors="replace"), config)
        patterns = None if files is None else ["README.md", *files]
    except (RemoteEntryNotFoundError, LocalEntryNotFoundError):  # no card, or none cached: every file is data
        patterns = None
    try:
        return Path(snapshot_download(rev.repo_id, allow_patterns=patterns, **where))
    except Exception as e:  # not cached and not reachable, an incomplete cached snapshot, refused
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise hub_refusal(key, rev.repo_id, "dataset", rev.commit, f"its files cannot be fetched ({reason})") from None


def load_raw(source: str | list[str], split: str, config: str | None = None, hub_dir: Path | None = None):
    from datasets import load_dataset

    if hub_dir is not None:  # a Hub dataset, read from its snapshot at the resolved commit
        return _load_repo(str(hub_dir), split, config, shown=str(source))
    repo = dataset_repo(source)
    if repo is not None:
        return _load_repo(repo, split, config)
    if config is not None:
        raise ValueError(
            f"data.config={config!r} names a configuration of a dataset repository, but data.source {source!r} is "
            "plain data files; drop data.config, or point data.source at a Hub dataset or a dataset folder whose "
            "README declares its configs"
        )
    files = local_data_files(source)
    builder = _BUILDERS[files[0].suffix]
    if builder == "json" and encodes_here(sum(f.stat().st_size for f in files), usable_cores()):
        rows = _json_lines(files)
        if rows is not None:
            return rows
    kwargs = {"sample_by": "paragraph"} if builder == "text" else {}
    return load_dataset(builder, data_files=[str(f) for f in files], split="train", **kwargs)


def _json_lines(files: list[Path]):
    """The rows of the JSON Lines ``files`` as an in-memory ``Dataset``, read by pyarrow's JSON
    reader (the one ``datasets``' JSON loader calls), or None where it refuses them: not JSON Lines
    (a JSON array), a field whose type changes between rows. ``load_dataset`` handles those; for
    the rest it builds the same table, but first parses every line of the first 10 MB again in
    Python to look for such fields: about ten times pyarrow's own time (measured on 5 MB of chat
    JSONL, single-core work of 0.17 s against 0.02 s). Only sources :func:`encodes_here` come here,
    and their examples are encoded in memory (``data._encoded_here``), so nothing is written:
    ``load_dataset`` would write the table to its cache first. One file is read where it lies (mapped
    into memory); several are joined into one buffer first, so that they make one table."""
    import pyarrow as pa
    import pyarrow.json as paj
    from datasets import Dataset
    from datasets.table import InMemoryTable

    try:
        if len(files) == 1:
            with pa.memory_map(str(files[0])) as source:
                table = paj.read_json(source)
        else:  # one table, one schema
            table = paj.read_json(pa.BufferReader(b"\n".join(f.read_bytes().rstrip(b"\n") for f in files)))
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
        return None
    # Named by content, as datasets would name it, without hashing the table.
    key = hashlib.sha256(json.dumps([pa.__version__, *map(sha256_file, files)]).encode()).hexdigest()[:16]
    return Dataset(InMemoryTable(table), fingerprint=key)


def _load_repo(repo: str, split: str, config: str | None, shown: str | None = None):
    """``load_dataset(repo, config, split)`` of a dataset folder (a local one, or a Hub dataset's
    snapshot that refusals call ``shown``), with a refusal naming the configs or splits that exist."""
    from datasets import get_dataset_config_names, load_dataset

    if not Path(repo).expanduser().is_dir():  # a Hub name is read through hub_dataset_dir only
        raise ValueError(f"data.source {repo!r} is not a dataset folder")
    names = get_dataset_config_names(str(Path(repo).expanduser()))
    if config not in names and not (config is None and len(names) == 1):
        what = f"has no config {config!r}" if config else "has several configs"
        raise ValueError(f"data.source {shown or repo!r} {what}; set data.config to one of {names}")
    try:
        return load_dataset(repo, name=config, split=split)
    except ValueError as e:  # unknown config or split of a Hub dataset: datasets names the choices
        key = "data.split" if "split" in str(e).lower() else "data.config"
        raise ValueError(f"{key}: {str(e).splitlines()[0]}") from None
