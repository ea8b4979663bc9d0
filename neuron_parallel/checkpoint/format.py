"""The on-disk checkpoint format, how to find checkpoints in a run directory, the model files a
checkpoint carries, and the identity of a LoRA checkpoint's base model.

```
run_dir/checkpoint-<step>/
  shards/tp_rank_XX_pp_rank_YY/model.safetensors        local model shards of that (tp, pp) rank
  shards/tp_rank_XX_pp_rank_YY/optim/dp_rank_ZZ.safetensors   optimizer state held by that dp rank
                                                        (the dp × cp rank under context parallelism)
  config.json, generation_config.json, tokenizer files  copied from the model, so a checkpoint
                                                        consolidates on its own
  trainer_state.json   step, tokens seen, data position, LR schedule, seeds, last metrics
  manifest.json        format version, parallel config, model config, every file (size, sha256),
                       every tensor (HF name, global shape, dtype, the slice each file holds)
  COMPLETE             written last; a checkpoint without it does not exist
```

Why our own writer rather than DCP's ``FileSystemWriter``: DCP's metadata file is a pickle, and
a checkpoint must never need unpickling to be read; its file names cannot express the
``tp_rank_XX_pp_rank_YY`` layout that neighbouring tools expect; and the manifest's per-file
checksums and per-tensor slices are what validation, resharding and streaming consolidation all
read. The data itself is plain safetensors, loadable by any tool.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

from ..utils import read_json, sha256_file

FORMAT_NAME = "neuron-flows-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.json"
COMPLETE = "COMPLETE"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)
"""The files a Hugging Face tokenizer is saved as (a model directory has some of them): copied into
checkpoints and exports, and hashed, in this order, into the tokenized dataset's fingerprint."""
HF_FILES = ("config.json", "generation_config.json", *TOKENIZER_FILES)
"""The files besides the weights that a checkpoint copies from its model and an export writes."""
_CKPT_RE = re.compile(r"^checkpoint-(\d+)$")


def confined(root: str | Path, rel: Any, what: str, *, also: Iterable[Path] = ()) -> Path:
    """``root / rel``, refusing a path that could lead out of ``root``: ``rel`` must be a relative
    path (``/``-separated) without ``..`` components, and what it resolves to, every symbolic link
    on the way followed to its end, must lie inside ``root`` resolved the same way (or inside one
    of the folders ``also`` names, resolved: see :func:`hub_blobs` for the one such folder). The
    one rule for every file read from a folder a user or a file names. ``what`` says where ``rel``
    was read (``"<manifest>: files entry"``), for the ``ValueError``."""
    allowed = "a relative path inside the folder, without '..' components or links that lead out of it"
    if not isinstance(rel, str) or not rel or "\\" in rel or "\0" in rel:
        raise ValueError(f"{what} {rel!r} is not a file name; only {allowed} is allowed")
    pure = PurePosixPath(rel)
    if pure.is_absolute() or PureWindowsPath(rel).drive or ".." in pure.parts:
        raise ValueError(f"{what} {rel!r} points outside {root}; only {allowed} is allowed")
    path = Path(root) / rel
    target = Path(os.path.realpath(path))
    for folder in (Path(root), *also):
        if target.is_relative_to(os.path.realpath(folder)):
            return path
    raise ValueError(
        f"{what} {rel!r} resolves to {target}, outside {root}; only {allowed} is allowed: copy the file into "
        f"{root} in place of the link"
    )


def hub_blobs(model_dir: str | Path) -> tuple[Path, ...]:
    """The folder besides ``model_dir`` that its files may link into: for a Hugging Face hub cache
    snapshot (``<repo>/snapshots/<revision>/``), whose files are links into ``<repo>/blobs/``, that
    folder; nothing for any other folder. ``model_dir`` is resolved first (a link to a snapshot is
    one). ``blobs`` must be a folder inside ``<repo>``, links followed: one that leads elsewhere
    (``blobs -> /``) would let a link reach any file, and is refused with a ``ValueError``."""
    real = Path(os.path.realpath(model_dir))
    repo = real.parent.parent
    blobs = repo / "blobs"
    if real.parent.name != "snapshots" or not blobs.is_dir():
        return ()
    target = Path(os.path.realpath(blobs))
    if target == repo or not target.is_relative_to(repo):
        raise ValueError(
            f"{blobs} leads to {target}, outside {repo}: the files of a Hugging Face cache snapshot may link "
            f"only into the blobs folder of their own repo; download the model again, or copy the files of "
            f"{model_dir} into a plain folder and point at that"
        )
    return (blobs,)


def user_model_files(model_dir: str | Path, names: Iterable[str] = HF_FILES) -> list[Path]:
    """The files ``names`` present in the user's model directory ``model_dir`` (copied into
    checkpoints and exports, and so uploaded): none may be a link that leads out of it, or, in a
    Hugging Face cache snapshot, out of its repo's ``blobs/`` (:func:`confined`)."""
    d = Path(model_dir)
    also = hub_blobs(d)
    return [p for n in names if (p := confined(d, n, f"{d}: model file", also=also)).is_file()]


def model_files(ckpt: Path, model_dir: str | Path | None, names: Iterable[str] = HF_FILES) -> list[Path]:
    """The files ``names`` present in ``model_dir`` (the user's model directory), else in the
    checkpoint folder ``ckpt``; none may lead out of its folder."""
    if model_dir is not None:
        return user_model_files(model_dir, names)
    return [p for n in names if (p := confined(ckpt, n, f"{ckpt / MANIFEST}: model file")).is_file()]


def shard_dir(tp_rank: int, pp_rank: int) -> str:
    return f"shards/tp_rank_{tp_rank:02d}_pp_rank_{pp_rank:02d}"


def model_file(tp_rank: int, pp_rank: int) -> str:
    return f"{shard_dir(tp_rank, pp_rank)}/model.safetensors"


def optim_file(tp_rank: int, pp_rank: int, dp_rank: int) -> str:
    return f"{shard_dir(tp_rank, pp_rank)}/optim/dp_rank_{dp_rank:02d}.safetensors"


@dataclass(slots=True)
class Piece:
    """One rectangular slice of a global tensor stored under ``key`` in ``file``."""

    file: str
    key: str
    offsets: list[int]
    shape: list[int]


@dataclass(slots=True)
class TensorEntry:
    """A global tensor: its Hugging Face name (or optimizer-state name), shape, dtype, pieces."""

    shape: list[int]
    dtype: str
    kind: str  # "model" or "optim"
    pieces: list[Piece] = field(default_factory=list)


@dataclass(slots=True)
class Manifest:
    step: int
    parallel: dict[str, Any]
    model_config: dict[str, Any]
    files: dict[str, dict[str, Any]]
    tensors: dict[str, TensorEntry]
    format: str = FORMAT_NAME
    format_version: int = FORMAT_VERSION
    adapter: dict[str, Any] | None = None
    """LoRA checkpoints only: ``{"lora": <LoraConfig fields>, "base_model": {"name_or_path",
    "sha256"}}``; the model tensors are then the adapters (``<layer>.lora_A`` r × in,
    ``<layer>.lora_B`` out × r) and ``modules_to_save``, and the frozen base is the model named."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def load(cls, ckpt_dir: str | Path) -> Manifest:
        path = Path(ckpt_dir) / MANIFEST
        raw = read_json(path)
        if not isinstance(raw, dict) or raw.get("format") != FORMAT_NAME:
            found = raw.get("format") if isinstance(raw, dict) else type(raw).__name__
            raise ValueError(f"{path} is not a {FORMAT_NAME} manifest (format={found!r})")
        if raw.get("format_version", 0) > FORMAT_VERSION:
            raise ValueError(
                f"{path} has format_version {raw['format_version']}, newer than this release reads "
                f"({FORMAT_VERSION}); upgrade neuron-flows"
            )
        tensors = {
            name: TensorEntry(
                shape=t["shape"], dtype=t["dtype"], kind=t["kind"], pieces=[Piece(**p) for p in t["pieces"]]
            )
            for name, t in raw["tensors"].items()
        }
        _check_paths(path, raw["files"], tensors)
        return cls(
            step=raw["step"],
            parallel=raw["parallel"],
            model_config=raw["model_config"],
            files=raw["files"],
            tensors=tensors,
            format=raw["format"],
            format_version=raw["format_version"],
            adapter=raw.get("adapter"),
        )


def _check_paths(path: Path, files: Any, tensors: dict[str, TensorEntry]) -> None:
    """Every file a manifest names (``files`` and each piece's ``file``) stays inside its folder;
    each name is resolved once, however many pieces it holds."""
    if not isinstance(files, dict):
        raise ValueError(f"{path}: 'files' is a {type(files).__name__}, not a mapping of file name → size and sha256")
    for rel in files:
        confined(path.parent, rel, f"{path}: files entry")
    for name, entry in tensors.items():
        for piece in entry.pieces:
            if not (isinstance(piece.file, str) and piece.file in files):
                confined(path.parent, piece.file, f"{path}: tensor {name} piece file")


def checkpoint_step(path: Path) -> int | None:
    m = _CKPT_RE.match(path.name)
    return int(m.group(1)) if m else None


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Every ``checkpoint-<step>`` folder in ``run_dir``, oldest first (complete or not)."""
    run = Path(run_dir)
    if not run.is_dir():
        return []
    found = [(checkpoint_step(p), p) for p in run.iterdir() if p.is_dir() and checkpoint_step(p) is not None]
    return [p for _, p in sorted(found)]


def is_complete(ckpt_dir: Path) -> bool:
    return (ckpt_dir / COMPLETE).is_file() and (ckpt_dir / MANIFEST).is_file()


def resolve_checkpoint(path: str | Path) -> Path:
    """Accept a run dir (newest complete checkpoint), a checkpoint dir, or its ``shards/`` folder."""
    p = Path(path)
    if not p.exists():
        raise ValueError(f"{p} does not exist")
    if p.name == "shards":
        p = p.parent
    if (p / MANIFEST).exists() or checkpoint_step(p) is not None:
        return p
    complete = [c for c in list_checkpoints(p) if is_complete(c)]
    if not complete:
        raise ValueError(f"{p} holds no complete checkpoint-<step> folder (with {MANIFEST} and {COMPLETE})")
    return complete[-1]


_WEIGHTS_DIGESTS: dict[tuple, str] = {}
"""Digests of model folders' weights already read by this process, keyed by each weight file's
name, inode, size and modification time: one process (the flow's, running the reference, train
and evaluate steps) hashes a base model's weights once, not at every step that names it."""


def base_model_identity(model_path: str | Path) -> dict:
    """What a LoRA checkpoint records of its frozen base: the model's path or name and a digest
    of its weight files' contents (see :func:`check_base_model`)."""
    files = sorted(Path(model_path).glob("*.safetensors"))
    stats = [f.stat() for f in files]
    key = tuple((str(f.resolve()), st.st_ino, st.st_size, st.st_mtime_ns) for f, st in zip(files, stats))
    if key not in _WEIGHTS_DIGESTS:
        h = hashlib.sha256()
        for f in files:
            h.update(f.name.encode() + sha256_file(f).encode())
        _WEIGHTS_DIGESTS[key] = h.hexdigest()
    return {"name_or_path": str(model_path), "sha256": _WEIGHTS_DIGESTS[key]}


def check_base_model(manifest: Manifest, base: dict) -> None:
    """Refuse a LoRA checkpoint's adapters on another base model than the one they were trained
    on, whether to resume training or to merge them: ``base`` is the base model at hand, as
    :func:`base_model_identity` describes it. A full fine-tuning checkpoint has no base to check."""
    saved = (manifest.adapter or {}).get("base_model")
    if saved and saved["sha256"] != base["sha256"]:
        raise ValueError(
            f"base model {base['name_or_path']} holds other weights (sha256 {base['sha256'][:12]}…) than the "
            f"checkpoint's adapters were trained on ({saved['name_or_path']}, sha256 {saved['sha256'][:12]}…); "
            "to resume, point model.name_or_path at that original base model or start a new run; to merge, "
            "pass --base-dir (base_dir=) pointing at it"
        )
