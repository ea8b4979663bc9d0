"""On-disk layout of optimum-neuron / neuronx-distributed checkpoints: finding the files,
loading rank files safely, and the metadata that describes how each tensor was split."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .format import confined

SHARDS_DIRS = ("shards", "tensor_parallel_shards")
DONE = "done"
_TRAINER_FILE = re.compile(r"^dp_rank_(\d+)_tp_rank_(\d+)_pp_rank_(\d+)\.pt$")
_LEGACY_NAME = re.compile(r"^tp_rank_(\d+)_pp_rank_(\d+)(?:_dp_rank_(\d+))?$")
_METADATA = re.compile(r"^mp_metadata_pp_rank_(\d+)\.(json|pt)$")


class _TensorReference:
    """Stand-in for ``torch_xla.utils.serialization.TensorReference``: the id of a tensor file."""

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2:  # how a __slots__ variant pickles: (dict, slots)
            state = {**(state[0] or {}), **(state[1] or {})}
        tid = state.get("tid") if isinstance(state, dict) else None
        if not isinstance(tid, int):
            raise ValueError(f"xser tensor reference without an integer id: {state!r}")
        self.tid = tid


_XSER_GLOBALS = [(_TensorReference, "torch_xla.utils.serialization.TensorReference")]


def _load(path: Path, *, mmap: bool) -> Any:
    """``torch.load`` with ``weights_only=True`` (and mmap where the file format allows it)."""
    with torch.serialization.safe_globals(_XSER_GLOBALS):
        if mmap:
            try:
                return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as e:  # pre-zipfile torch.save format: cannot be mapped
                if "mmap" not in str(e):
                    raise
        return torch.load(path, map_location="cpu", weights_only=True)


def _looks_neuronx(shards: Path) -> bool:
    if not shards.is_dir() or (shards.parent / "manifest.json").exists():
        return False
    if (shards / "model").is_dir() or any(_METADATA.match(p.name) for p in shards.iterdir()):
        return True
    for p in shards.iterdir():
        if _LEGACY_NAME.match(p.name) and (p.is_file() or (p / "checkpoint.pt").is_file()):
            return True
    return False


def find_neuronx_checkpoint(path: str | Path) -> Path | None:
    """The shards folder of the optimum-neuron / neuronx-distributed checkpoint at ``path`` (the
    folder itself, the checkpoint dir holding it, or a run dir → its newest ``checkpoint-<step>``
    with ``shards/done``), or None when ``path`` is not one."""
    p = Path(path)
    if not p.is_dir():
        return None
    if p.name in SHARDS_DIRS:
        return p if _looks_neuronx(p) else None
    for name in SHARDS_DIRS:
        if _looks_neuronx(p / name):
            return p / name
    steps = []
    for c in p.iterdir():
        m = re.fullmatch(r"checkpoint-(\d+)", c.name)
        if m and c.is_dir() and _looks_neuronx(c / "shards") and (c / "shards" / DONE).is_file():
            steps.append((int(m.group(1)), c / "shards"))
    return max(steps)[1] if steps else None


class _RankFile:
    """One rank's state dict: names, shapes and dtypes up front; data memory-mapped on use."""

    def __init__(self, path: Path, *, xser: bool, legacy: bool) -> None:
        self.path, self.xser = path, xser
        obj = _load(path, mmap=True)
        self.extra = obj if legacy else {}
        state = obj.get("model", obj) if legacy and isinstance(obj, dict) else obj
        if not isinstance(state, dict):
            raise ValueError(f"{path}: holds a {type(state).__name__}, not a state dict")
        self.state = state
        self._meta: dict[str, tuple[list[int], torch.dtype]] = {}
        info = path.with_name(path.name + ".info.pt")  # {id: {dtype, shape}}, written by neuronx-distributed > 0.6
        try:
            self._info = _load(self._inside(info.name), mmap=False) if xser and info.is_file() else {}
        except Exception:  # only a shortcut: shapes are then read from the tensor files
            self._info = {}

    @property
    def tensors_dir(self) -> Path:
        return Path(str(self.path) + ".tensors")

    def _inside(self, rel: str) -> Path:
        """``rel`` beside the rank file, refused if a link leads it out of the rank file's folder."""
        return confined(self.path.parent, rel, f"{self.path}: xser file")

    def _tensor_file(self, tid: int) -> Path:
        return self._inside(f"{self.tensors_dir.name}/tensor_{tid}.pt")

    def keys(self) -> list[str]:
        return [k for k, v in self.state.items() if isinstance(v, (torch.Tensor, _TensorReference))]

    def missing_tensor_files(self) -> list[Path]:
        refs = [v for v in self.state.values() if isinstance(v, _TensorReference)]
        return [f for f in (self._tensor_file(r.tid) for r in refs) if not f.is_file()]

    def meta(self, key: str) -> tuple[list[int], torch.dtype]:
        if key not in self._meta:
            v = self.state[key]
            info = self._info.get(v.tid) if isinstance(v, _TensorReference) else None
            if isinstance(info, dict) and "shape" in info and "dtype" in info:
                self._meta[key] = (list(info["shape"]), info["dtype"])
            else:
                t = self.get(key)
                self._meta[key] = (list(t.shape), t.dtype)
        return self._meta[key]

    def get(self, key: str) -> torch.Tensor:
        v = self.state[key]
        if isinstance(v, _TensorReference):
            v = _load(self._tensor_file(v.tid), mmap=True)
        if not isinstance(v, torch.Tensor):
            raise ValueError(f"{self.path}: {key} is a {type(v).__name__}, not a tensor")
        return v


@dataclass(slots=True)
class _Param:
    """How one saved parameter is split over the tp ranks of its stage."""

    parallel: bool = False
    dim: int = 0
    stride: int = 1


@dataclass(slots=True)
class _Fused:
    """Several linears fused into one ColumnParallel/RowParallel weight (``gate_up_proj``, MHA
    ``qkv_proj``): each rank holds ``[piece_0; piece_1; ...]`` along ``axis``, piece i being its
    share (``dims[i] // tp``) of linear i."""

    key: str
    outputs: list[str]
    dims: list[int]
    axis: int
    tp: int


@dataclass(slots=True)
class _GQA:
    """The GQA QKV layer: Q heads permuted across ranks (and the output projection's columns with
    them), K/V replicated ``kv_mult`` times; one entry per parameter (weight or bias)."""

    sources: tuple[str, ...]  # (fused qkv key,) or (q key, k key, v key)
    q: str  # the Hugging Face names written
    k: str
    v: str
    o: str | None  # the output projection weight whose columns follow the Q permutation
    num_heads: int
    num_kv_heads: int
    kv_mult: int
    q_rows: int | None  # rows of Q and of K (= of V) in a rank's fused qkv weight
    kv_rows: int | None
    permuted: bool
    tp: int


@dataclass
class _Stage:
    pp_rank: int
    ranks: list[_RankFile]
    params: dict[str, _Param] = field(default_factory=dict)
    fused: list[_Fused] = field(default_factory=list)
    gqa: list[_GQA] = field(default_factory=list)


def query_head_order(tp: int, tp_rank: int, num_heads: int, num_kv_heads: int, kv_mult: int) -> torch.Tensor:
    """Global query heads held, in order, by ``tp_rank`` of the GQA QKV layer: the kv heads
    ``0..num_kv_heads-1`` are laid out ``kv_mult`` times over the ranks, and each rank takes, for
    each kv head it holds, the next query heads of that kv head's group."""
    heads_per_rank = num_heads // tp
    kv_per_rank = num_kv_heads * kv_mult // tp
    group = num_heads // num_kv_heads
    q_per_kv = heads_per_rank // kv_per_rank
    kv_of_slot = torch.arange(num_kv_heads).repeat(kv_mult).repeat_interleave(q_per_kv).chunk(tp)[tp_rank]
    ranks_per_kv_cycle = num_kv_heads // kv_per_rank
    offset = torch.arange(0, group, q_per_kv).repeat_interleave(ranks_per_kv_cycle * heads_per_rank).chunk(tp)[tp_rank]
    return torch.arange(heads_per_rank) % q_per_kv + kv_of_slot * group + offset


def _locate_files(shards: Path) -> tuple[str, bool, dict[tuple[int, int], Path]]:
    """(layout: "trainer" or "legacy", xser, {(tp_rank, pp_rank): rank file}); dp_rank 0 only,
    the one that holds model weights."""
    files: dict[tuple[int, int], Path] = {}
    model = shards / "model"
    if model.is_dir():
        for p in model.iterdir():
            m = _TRAINER_FILE.match(p.name)
            if m and p.is_file() and int(m.group(1)) == 0:
                files[int(m.group(2)), int(m.group(3))] = p
        xser = any(p.name.endswith(".pt.tensors") and p.is_dir() for p in model.iterdir())
        for path in files.values():  # names matched a pattern; a link may still lead elsewhere
            confined(shards, path.relative_to(shards).as_posix(), f"{shards}: rank file")
        return "trainer", xser, files
    xser = False
    for p in shards.iterdir():
        m = _LEGACY_NAME.match(p.name)
        if not m or int(m.group(3) or 0) != 0:
            continue
        if (p / "checkpoint.pt").is_file():
            files[int(m.group(1)), int(m.group(2))] = p / "checkpoint.pt"
        elif p.is_file():
            files[int(m.group(1)), int(m.group(2))] = p
            xser = True
    for path in files.values():  # names matched a pattern; a link may still lead elsewhere
        confined(shards, path.relative_to(shards).as_posix(), f"{shards}: rank file")
    return "legacy", xser, files


def _find_config(ckpt_dir: Path, model_dir: str | Path | None) -> tuple[Path | None, str | None]:
    """(folder whose config/tokenizer files to use, or None; the problem when there is none)."""
    if model_dir is not None:
        d = Path(model_dir)
        return (d, None) if (d / "config.json").is_file() else (None, f"{d / 'config.json'}: missing (--model-dir)")
    for d in (ckpt_dir, ckpt_dir.parent):
        if (d / "config.json").is_file():
            confined(d, "config.json", f"{d}: model file")
            return d, None
    return None, (
        f"no config.json in {ckpt_dir} or {ckpt_dir.parent}; pass --model-dir DIR (model_dir=...), a Hugging "
        "Face model directory whose config and tokenizer belong to this checkpoint"
    )


def _vocab_trimmed(name: str, shape: list[int], config: dict) -> list[int]:
    """Rows a vocab-padded embedding or lm_head holds beyond the config's vocab_size are dropped."""
    vocab = config.get("vocab_size")
    if (name == "lm_head.weight" or name.endswith("embed_tokens.weight")) and vocab and shape[0] > vocab:
        return [vocab, *shape[1:]]
    return shape
