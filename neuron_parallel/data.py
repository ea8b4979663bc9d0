"""Tokenization, packing and the deterministic order in which training reads the blocks.

Tokenization uses ``datasets`` (batched ``map``, ``save_to_disk``). Each packed row holds
``block_size + 1`` tokens, so every one of the ``block_size`` input positions has its next
token as the label, and the sequence length the model sees divides cleanly for sequence
parallelism.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import DataConfig
from .utils import sha256_file

FORMAT_VERSION = 1
_BUILDERS = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}


@dataclass(frozen=True, slots=True)
class TokenizedDataset:
    """A packed dataset on disk: what the tokenize step hands to training."""

    path: str
    fingerprint: str
    num_tokens: int
    num_blocks: int
    block_size: int


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
    return None if path.exists() else (source if _local_files(source) is None else None)


def _local_files(source: str | list[str]) -> list[Path] | None:
    """The data files named by ``source``, or None when it is a Hub dataset name."""
    items = [source] if isinstance(source, str) else list(source)
    paths = [Path(s).expanduser() for s in items]
    if not all(p.exists() for p in paths):
        missing = [str(p) for p in paths if not p.exists()]
        if isinstance(source, str) and not source.startswith((".", "/", "~")) and source.count("/") <= 1:
            return None  # looks like a Hub id such as "org/name"
        raise ValueError(f"data.source: no such file or directory: {', '.join(missing)}")
    files: list[Path] = []
    for p in paths:
        files.extend(sorted(q for q in p.rglob("*") if q.suffix in _BUILDERS) if p.is_dir() else [p])
    if not files:
        raise ValueError(f"data.source {source!r} holds no .txt/.jsonl/.json/.parquet files")
    kinds = {_BUILDERS.get(f.suffix) for f in files}
    if None in kinds or len(kinds) != 1:
        raise ValueError(
            f"data.source mixes or has unsupported file types {sorted(f.suffix for f in files)}; "
            f"use one of {sorted(_BUILDERS)}"
        )
    return files


def dataset_fingerprint(
    source: str | list[str],
    tokenizer_dir: str | Path,
    *,
    block_size: int,
    text_field: str,
    split: str,
    config: str | None = None,
) -> str:
    """A digest of everything that determines the packed blocks: file contents (or the Hub name),
    the dataset config and split, the tokenizer files, the block size, the text field and this
    format's version."""
    h = hashlib.sha256()
    repo = dataset_repo(source)
    if repo is None:
        files = _local_files(source)
    elif Path(repo).expanduser().is_dir():  # a local dataset folder: every file in it counts
        files = sorted(p for p in Path(repo).expanduser().rglob("*") if p.is_file() and ".git" not in p.parts)
    else:
        files = None
    h.update(json.dumps([FORMAT_VERSION, block_size, text_field, split, config]).encode())
    if files is None:
        h.update(f"hub:{source}".encode())
    else:
        for f in files:
            h.update(sha256_file(f).encode())
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "tokenizer.model"):
        p = Path(tokenizer_dir) / name
        if p.exists():
            h.update(name.encode() + sha256_file(p).encode())
    return h.hexdigest()[:20]


def _load_raw(source: str | list[str], split: str, config: str | None = None):
    from datasets import load_dataset

    repo = dataset_repo(source)
    if repo is not None:
        return _load_repo(repo, split, config)
    if config is not None:
        raise ValueError(
            f"data.config={config!r} names a configuration of a dataset repository, but data.source {source!r} is "
            "plain data files; drop data.config, or point data.source at a Hub dataset or a dataset folder whose "
            "README declares its configs"
        )
    files = _local_files(source)
    builder = _BUILDERS[files[0].suffix]
    kwargs = {"sample_by": "paragraph"} if builder == "text" else {}
    return load_dataset(builder, data_files=[str(f) for f in files], split="train", **kwargs)


def _load_repo(repo: str, split: str, config: str | None):
    """``load_dataset(repo, config, split)``, with a refusal naming the configs or splits that
    exist (checked before loading for a local folder, which needs no network)."""
    from datasets import get_dataset_config_names, load_dataset

    if Path(repo).expanduser().is_dir():
        names = get_dataset_config_names(str(Path(repo).expanduser()))
        if config not in names and not (config is None and len(names) == 1):
            what = f"has no config {config!r}" if config else "has several configs"
            raise ValueError(f"data.source {repo!r} {what}; set data.config to one of {names}")
    try:
        return load_dataset(repo, name=config, split=split)
    except ValueError as e:  # unknown config or split of a Hub dataset: datasets names the choices
        key = "data.split" if "split" in str(e).lower() else "data.config"
        raise ValueError(f"{key}: {str(e).splitlines()[0]}") from None


def tokenize_dataset(
    *,
    source: str | list[str],
    tokenizer_dir: str | Path,
    block_size: int,
    cache_dir: str | Path,
    text_field: str = "text",
    split: str = "train",
    config: str | None = None,
    num_proc: int | None = None,
) -> TokenizedDataset:
    """Tokenize ``source`` with the tokenizer in ``tokenizer_dir``, append EOS to every document,
    concatenate and cut into rows of ``block_size + 1`` tokens (the remainder is dropped), and
    save under ``cache_dir/<fingerprint>``. An existing complete result is reused."""
    from transformers import AutoTokenizer

    if block_size < 2:
        raise ValueError(f"data.block_size must be >= 2, got {block_size}")
    fingerprint = dataset_fingerprint(
        source, tokenizer_dir, block_size=block_size, text_field=text_field, split=split, config=config
    )
    out = Path(cache_dir) / fingerprint
    info_path = out / "neuron_flows_dataset.json"
    if info_path.exists():
        return TokenizedDataset(**json.loads(info_path.read_text()))

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tokenizer.model_max_length = 1 << 62  # documents are packed into blocks, so no length limit applies
    if tokenizer.eos_token_id is None:
        raise ValueError(f"the tokenizer in {tokenizer_dir} has no eos_token; packing needs one to separate documents")
    raw = _load_raw(source, split, config)
    if text_field not in raw.column_names:
        raise ValueError(f"data.text_field={text_field!r} is not a column of {source!r}; columns: {raw.column_names}")
    eos = tokenizer.eos_token_id
    row = block_size + 1

    def encode(batch):
        ids = tokenizer(batch[text_field], add_special_tokens=False)["input_ids"]
        return {"ids": [x + [eos] for x in ids]}

    def pack(batch):
        flat = [t for ids in batch["ids"] for t in ids]
        usable = len(flat) // row * row
        return {"input_ids": [flat[i : i + row] for i in range(0, usable, row)]}

    tokens = raw.map(encode, batched=True, remove_columns=raw.column_names, num_proc=num_proc)
    num_tokens = sum(len(x) for x in tokens["ids"])
    # One packing batch spans many documents so little is dropped at batch edges.
    packed = tokens.map(pack, batched=True, batch_size=10_000, remove_columns=["ids"], num_proc=num_proc)
    if len(packed) == 0:
        raise ValueError(
            f"{source!r} has {num_tokens} tokens, fewer than one block of {row}; lower data.block_size or add data"
        )
    # A private temporary name, renamed into place: several nodes (or runs) may tokenize the
    # same data into a shared cache at once, and whichever finishes first wins.
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    packed.with_format("numpy").save_to_disk(str(tmp))
    result = TokenizedDataset(
        path=str(out), fingerprint=fingerprint, num_tokens=num_tokens, num_blocks=len(packed), block_size=block_size
    )
    (tmp / info_path.name).write_text(json.dumps(dataclasses.asdict(result)))
    try:
        tmp.rename(out)
    except OSError:
        if not info_path.exists():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    return result


class BlockStream:
    """The order training reads packed blocks in: a seeded permutation per epoch, consumed
    sequentially, so optimizer step ``s`` always sees global samples ``[s·G, (s+1)·G)``
    whatever the parallel layout and wherever a resumed run starts."""

    def __init__(self, path: str | Path, *, seed: int) -> None:
        from datasets import load_from_disk

        self.dataset = load_from_disk(str(path)).with_format("torch")
        self.num_blocks = len(self.dataset)
        self.seed = seed
        self._perm: tuple[int, torch.Tensor] | None = None

    def _permutation(self, epoch: int) -> torch.Tensor:
        if self._perm is None or self._perm[0] != epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm = (epoch, torch.randperm(self.num_blocks, generator=g))
        return self._perm[1]

    def indices(self, start: int, count: int) -> list[int]:
        """Dataset rows for global sample positions ``start .. start + count - 1``."""
        out = []
        for g in range(start, start + count):
            epoch, pos = divmod(g, self.num_blocks)
            out.append(int(self._permutation(epoch)[pos]))
        return out

    def batch(self, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, labels)`` of shape ``(count, block_size)`` for those positions."""
        rows = self.dataset[self.indices(start, count)]["input_ids"]
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def tokenize_data(data: DataConfig, tokenizer_dir: str | Path) -> TokenizedDataset:
    """``tokenize_dataset`` for the ``data`` section of a run's config."""
    return tokenize_dataset(
        source=data.source,
        tokenizer_dir=tokenizer_dir,
        block_size=data.block_size,
        cache_dir=data.cache_dir,
        text_field=data.text_field,
        split=data.split,
        config=data.config,
    )
