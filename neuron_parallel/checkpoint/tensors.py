"""The slice-copying engine: read any rectangular slice of a global tensor from wherever it is
stored, one tensor at a time, through memory-mapped safetensors.

It serves resume on any topology (each rank reads the slice its new shard covers), streaming
consolidation (the whole tensor, piece by piece) and loading Hugging Face weights into sharded
parameters. Memory stays near the size of the slice being read.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import torch
from safetensors import safe_open

from ..parallel.dtensor import local_view
from .format import Manifest, Piece

__all__ = [
    "DTYPES",
    "CheckpointTensors",
    "HFWeights",
    "dtype_from_name",
    "dtype_from_safetensors",
    "dtype_name",
    "local_view",
    "safetensors_dtype",
]

DTYPES: tuple[tuple[torch.dtype, str], ...] = (
    (torch.float32, "F32"),
    (torch.bfloat16, "BF16"),
    (torch.float16, "F16"),
    (torch.int64, "I64"),
    (torch.int32, "I32"),
)
"""The tensor dtypes checkpoints hold, each with its safetensors header code. Our manifests
name a dtype as torch prints it without the ``torch.`` prefix (``float32``)."""


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` → ``"float32"``, the name manifests record."""
    return str(dtype).removeprefix("torch.")


_BY_NAME = {dtype_name(d): d for d, _ in DTYPES}
_BY_CODE = {code: d for d, code in DTYPES}
_CODES = {d: code for d, code in DTYPES}


def dtype_from_name(name: str) -> torch.dtype:
    """A manifest dtype name (``"float32"`` or ``"torch.float32"``) → ``torch.float32``."""
    return _BY_NAME[name.removeprefix("torch.")]


def dtype_from_safetensors(code: str) -> torch.dtype:
    """A safetensors header dtype (``"F32"``) → ``torch.float32``."""
    return _BY_CODE[code]


def safetensors_dtype(dtype: torch.dtype) -> str:
    """``torch.float32`` → ``"F32"``, the safetensors header dtype."""
    return _CODES[dtype]


def _overlap(a_off, a_shape, b_off, b_shape):
    """Intersection of two boxes as (offsets, shape), or None."""
    lo = [max(x, y) for x, y in zip(a_off, b_off)]
    hi = [min(x + n, y + m) for x, n, y, m in zip(a_off, a_shape, b_off, b_shape)]
    if any(h <= l for l, h in zip(lo, hi)):
        return None
    return lo, [h - l for l, h in zip(lo, hi)]


class _SafetensorsFile:
    """Slices of the tensors in one safetensors file, read with ``pread``.

    ``safe_open`` memory-maps the file, and every page a read touches stays mapped, and counted
    against the process, until the handle closes: streaming a whole checkpoint that way grows
    to the checkpoint's size. Reading the rows a slice needs into a fresh buffer keeps memory at
    the slice. The format is an 8-byte little-endian header length, a JSON header of
    ``{name: {dtype, shape, data_offsets}}`` and the raw bytes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            self.header = json.loads(f.read(n))
        self.data_start = 8 + n

    def read(self, key: str, offsets: list[int], shape: list[int]) -> torch.Tensor:
        """The box ``[offsets, offsets + shape)`` of tensor ``key``: one read of the rows along
        dim 0 it spans, then a view of the other dims."""
        info = self.header[key]
        dtype = dtype_from_safetensors(info["dtype"])
        full = info["shape"]
        if not full:
            rows, row_shape, r0 = 1, [], 0
        else:
            rows, row_shape, r0 = shape[0], full[1:], offsets[0]
        row_bytes = math.prod(row_shape) * torch.empty((), dtype=dtype).element_size()
        buf = torch.empty(rows * row_bytes, dtype=torch.uint8)  # uninitialised: no zero-fill pass
        with open(self.path, "rb", buffering=0) as f:
            f.seek(self.data_start + info["data_offsets"][0] + r0 * row_bytes)
            view, got = memoryview(buf.numpy()), 0
            while got < len(view):  # readinto may return short counts on large reads
                n = f.readinto(view[got:])
                if not n:
                    raise ValueError(f"{self.path}: {key} ends early (truncated file)")
                got += n
        t = buf.view(dtype).reshape([rows, *row_shape] if full else [])
        inner = tuple(slice(o, o + n) for o, n in zip(offsets[1:], shape[1:]))
        return t[(slice(None), *inner)] if inner else t


class _Files:
    """Parsed headers of a checkpoint's safetensors files, opened on first use."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._open: dict[str, _SafetensorsFile] = {}

    def get(self, rel: str) -> _SafetensorsFile:
        if rel not in self._open:
            self._open[rel] = _SafetensorsFile(self.root / rel)
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
        for piece in entry.pieces:  # one piece holds the whole box: return its rows, no copy
            if all(p <= o and o + n <= p + m for o, n, p, m in zip(offsets, shape, piece.offsets, piece.shape)):
                rel = [o - p for o, p in zip(offsets, piece.offsets)]
                return self._files.get(piece.file).read(piece.key, rel, shape)
        out = torch.empty(shape, dtype=dtype_from_name(entry.dtype))
        covered = 0
        for piece in entry.pieces:
            box = _overlap(offsets, shape, piece.offsets, piece.shape)
            if box is None:
                continue
            lo, size = box
            src = self._files.get(piece.file).read(piece.key, [l - p for l, p in zip(lo, piece.offsets)], size)
            dst_idx = tuple(slice(l - o, l - o + n) for l, o, n in zip(lo, offsets, size))
            out[dst_idx] = src
            covered += math.prod(size)
        if covered != math.prod(shape):
            raise ValueError(
                f"{self.root}: tensor {name} slice offsets={offsets} shape={shape} is covered by "
                f"{covered} of {math.prod(shape)} elements; the checkpoint is missing pieces"
            )
        return out

    def byte_ranges(self, name: str, rows: int) -> list[tuple[Path, int, int]] | None:
        """``(file, offset, nbytes)`` ranges that hold rows ``[0, rows)`` of ``name`` in order,
        when every piece is whole rows (split along dim 0 only, as column-parallel weights and
        the vocab-parallel embedding are); None otherwise."""
        entry = self.manifest.tensors[name]
        if not entry.shape:
            return None
        ranges, row = [], 0
        for piece in sorted(entry.pieces, key=lambda p: p.offsets[0]):
            if list(piece.shape[1:]) != list(entry.shape[1:]) or piece.offsets[0] != row:
                return None
            take = min(piece.shape[0], rows - row)
            if take <= 0:
                break
            f = self._files.get(piece.file)
            info = f.header[piece.key]
            row_bytes = math.prod(piece.shape[1:]) * dtype_from_name(entry.dtype).itemsize
            ranges.append((f.path, f.data_start + info["data_offsets"][0], take * row_bytes))
            row += take
        return ranges if row == rows else None

    def pieces(self, name: str) -> list[Piece]:
        return self.manifest.tensors[name].pieces


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

    def names(self) -> list[str]:
        """Every tensor's name, in the order the index or the file lists them."""
        return list(self.where)

    def shape_dtype(self, name: str) -> tuple[list[int], torch.dtype]:
        """The stored shape and dtype of tensor ``name``, from the file's header."""
        info = self._files.get(self.where[name]).header[name]
        try:
            return list(info["shape"]), dtype_from_safetensors(info["dtype"])
        except KeyError:
            raise ValueError(f"{self.root}: {name} has dtype {info['dtype']}, which this tool does not read") from None

    def byte_range(self, name: str) -> tuple[Path, int, int]:
        """``(file, offset, nbytes)`` of tensor ``name``'s bytes."""
        f = self._files.get(self.where[name])
        start, stop = f.header[name]["data_offsets"]
        return f.path, f.data_start + start, stop - start

    def read(self, name: str, offsets: list[int] | None = None, shape: list[int] | None = None) -> torch.Tensor:
        f = self._files.get(self.where[name])
        if offsets is None:
            shape = f.header[name]["shape"]
            offsets = [0] * len(shape)
        return f.read(name, offsets, shape)
