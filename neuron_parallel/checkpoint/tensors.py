"""The slice-copying engine: read any rectangular slice of a global tensor from wherever it is
stored, one tensor at a time, through memory-mapped safetensors.

It serves resume on any topology (each rank reads the slice its new shard covers), streaming
consolidation (the whole tensor, piece by piece) and loading Hugging Face weights into sharded
parameters. Memory stays near the size of the slice being read.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch.distributed.tensor import DTensor

from .format import Manifest, Piece

_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int64": torch.int64,
    "int32": torch.int32,
}


def dtype_from_name(name: str) -> torch.dtype:
    return _DTYPES[name.removeprefix("torch.")]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def local_view(t: torch.Tensor) -> tuple[torch.Tensor, list[int], list[int]]:
    """``(local tensor, global shape, global offsets)`` of a DTensor shard or a plain tensor."""
    if isinstance(t, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        _, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        return t.to_local(), list(t.shape), list(offsets)
    return t, list(t.shape), [0] * t.dim()


def _overlap(a_off, a_shape, b_off, b_shape):
    """Intersection of two boxes as (offsets, shape), or None."""
    lo = [max(x, y) for x, y in zip(a_off, b_off)]
    hi = [min(x + n, y + m) for x, n, y, m in zip(a_off, a_shape, b_off, b_shape)]
    if any(h <= l for l, h in zip(lo, hi)):
        return None
    return lo, [h - l for l, h in zip(lo, hi)]


class _Files:
    """Open safetensors files on demand and keep the handles (they are mmaps, not copies)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._open: dict[str, object] = {}

    def get(self, rel: str):
        if rel not in self._open:
            self._open[rel] = safe_open(str(self.root / rel), framework="pt", device="cpu")
        return self._open[rel]


class CheckpointTensors:
    """Global tensors of one of our checkpoints, readable slice by slice."""

    def __init__(self, ckpt_dir: str | Path, manifest: Manifest | None = None) -> None:
        self.root = Path(ckpt_dir)
        self.manifest = manifest or Manifest.load(self.root)
        self._files = _Files(self.root)

    def names(self, kind: str = "model") -> list[str]:
        return [n for n, t in self.manifest.tensors.items() if t.kind == kind]

    def __contains__(self, name: str) -> bool:
        return name in self.manifest.tensors

    def read(self, name: str, offsets: list[int] | None = None, shape: list[int] | None = None) -> torch.Tensor:
        """The slice ``[offsets, offsets + shape)`` of global tensor ``name`` (all of it by default)."""
        entry = self.manifest.tensors[name]
        offsets = offsets if offsets is not None else [0] * len(entry.shape)
        shape = shape if shape is not None else list(entry.shape)
        out = torch.empty(shape, dtype=dtype_from_name(entry.dtype))
        covered = 0
        for piece in entry.pieces:
            box = _overlap(offsets, shape, piece.offsets, piece.shape)
            if box is None:
                continue
            lo, size = box
            src = self._files.get(piece.file).get_slice(piece.key)
            src_idx = tuple(slice(l - p, l - p + n) for l, p, n in zip(lo, piece.offsets, size))
            dst_idx = tuple(slice(l - o, l - o + n) for l, o, n in zip(lo, offsets, size))
            out[dst_idx] = src[src_idx] if src_idx else src[:]
            covered += _numel(size)
        if covered != _numel(shape):
            raise ValueError(
                f"{self.root}: tensor {name} slice offsets={offsets} shape={shape} is covered by "
                f"{covered} of {_numel(shape)} elements; the checkpoint is missing pieces"
            )
        return out

    def pieces(self, name: str) -> list[Piece]:
        return self.manifest.tensors[name].pieces


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


class HFWeights:
    """Tensors of a Hugging Face model directory (``model.safetensors`` or a sharded index)."""

    def __init__(self, model_dir: str | Path) -> None:
        self.root = Path(model_dir)
        index = self.root / "model.safetensors.index.json"
        if index.exists():
            self.where = json.loads(index.read_text())["weight_map"]
        elif (self.root / "model.safetensors").exists():
            with safe_open(str(self.root / "model.safetensors"), framework="pt") as f:
                self.where = {k: "model.safetensors" for k in f.keys()}
        else:
            raise ValueError(
                f"{self.root} has no model.safetensors or model.safetensors.index.json; "
                "save the model with save_pretrained(safe_serialization=True)"
            )
        self._files = _Files(self.root)

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def read(self, name: str, offsets: list[int] | None = None, shape: list[int] | None = None) -> torch.Tensor:
        sl = self._files.get(self.where[name]).get_slice(name)
        if offsets is None:
            return sl[:]
        return sl[tuple(slice(o, o + n) for o, n in zip(offsets, shape))]
