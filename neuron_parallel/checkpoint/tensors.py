"""The slice-copying engine: read any rectangular slice of a global tensor from wherever it is
stored, one tensor at a time, through memory-mapped safetensors.

It serves resume on any topology (each rank reads the slice its new shard covers), streaming
consolidation (the whole tensor, piece by piece) and loading Hugging Face weights into sharded
parameters. Memory stays near the size of the slice being read.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

import torch

from ..utils import read_json
from .dtypes import dtype_from_name, dtype_from_safetensors, safetensors_dtype
from .format import MANIFEST, Manifest, Piece, confined, hub_blobs

__all__ = ["CheckpointTensors", "HFWeights"]

Ints = list[int] | None
"""An optional list of sizes or offsets, one per dimension."""


def _overlap(a_off, a_shape, b_off, b_shape):
    """Intersection of two boxes as (offsets, shape), or None."""
    lo = [max(x, y) for x, y in zip(a_off, b_off)]
    hi = [min(x + n, y + m) for x, n, y, m in zip(a_off, a_shape, b_off, b_shape)]
    if any(h <= l for l, h in zip(lo, hi)):
        return None
    return lo, [h - l for l, h in zip(lo, hi)]


MAX_HEADER_BYTES = 100_000_000
"""The largest safetensors JSON header read (the safetensors package's own limit)."""

_ITEMSIZE = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1,
    "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
    "U32": 4, "I32": 4, "F32": 4,
    "U64": 8, "I64": 8, "F64": 8,
}  # fmt: skip
"""Bytes per element of each safetensors dtype code, to check a header's byte ranges."""


def _check_header(path: Path, header: object, data_bytes: int) -> None:
    """Refuse a header whose tensors do not each lie in the file's data, within their own bytes:
    ``data_offsets`` non-negative, ordered, non-overlapping and inside the ``data_bytes`` after
    the header, each span exactly the bytes its dtype and shape need."""
    if not isinstance(header, dict):
        raise ValueError(f"{path}: the safetensors header is not a JSON object")
    spans = []
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise ValueError(
                f"{path}: header entry {key!r} lacks dtype, shape or a [begin, end] data_offsets"
            ) from None
        ints = [begin, end, *shape] if isinstance(shape, list) else None
        if ints is None or not all(type(v) is int and v >= 0 for v in ints):
            raise ValueError(
                f"{path}: {key} has shape {shape} and data_offsets {info['data_offsets']}; both must hold "
                "non-negative integers"
            )
        if not begin <= end <= data_bytes:
            raise ValueError(
                f"{path}: {key} has data_offsets [{begin}, {end}] beyond the {data_bytes} data bytes the file holds "
                "(truncated or damaged file)"
            )
        if dtype in _ITEMSIZE and end - begin != math.prod(shape) * _ITEMSIZE[dtype]:
            raise ValueError(
                f"{path}: {key} is {dtype} {shape}, {math.prod(shape) * _ITEMSIZE[dtype]} bytes, but its "
                f"data_offsets [{begin}, {end}] span {end - begin} bytes (damaged header)"
            )
        spans.append((begin, end, key))
    spans.sort()
    for (_, end, a), (begin, _, b) in zip(spans, spans[1:]):
        if begin < end:
            raise ValueError(f"{path}: the bytes of {a} and {b} overlap (damaged header)")


class _SafetensorsFile:
    """Slices of the tensors in one safetensors file, read with ``pread``.

    ``safe_open`` memory-maps the file, and every page a read touches stays mapped, and counted
    against the process, until the handle closes: streaming a whole checkpoint that way grows
    to the checkpoint's size. Reading the rows a slice needs into a fresh buffer keeps memory at
    the slice. The format is an 8-byte little-endian header length, a JSON header of
    ``{name: {dtype, shape, data_offsets}}`` and the raw bytes. The header is checked as it is
    read (its length against the file's, every tensor's bytes inside the file and of the size
    its shape needs), so no read can reach past the tensor it asks for."""

    def __init__(self, path: Path) -> None:
        self.path = path
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 8:
                raise ValueError(f"{path}: {size} bytes, too short to be a safetensors file")
            (n,) = struct.unpack("<Q", f.read(8))
            if n > min(MAX_HEADER_BYTES, size - 8):
                raise ValueError(
                    f"{path}: header length {n} bytes exceeds the file ({size} bytes) or the "
                    f"{MAX_HEADER_BYTES}-byte limit; not a safetensors file, or a damaged one"
                )
            try:
                self.header = json.loads(f.read(n))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise ValueError(f"{path}: unreadable safetensors header ({e})") from None
        self.data_start = 8 + n
        _check_header(path, self.header, size - self.data_start)

    def info(self, key: str) -> dict:
        """The header entry of tensor ``key``."""
        if key == "__metadata__" or key not in self.header:
            raise ValueError(f"{self.path}: holds no tensor {key}")
        return self.header[key]

    def read(self, key: str, offsets: list[int], shape: list[int]) -> torch.Tensor:
        """The box ``[offsets, offsets + shape)`` of tensor ``key``: one read of the rows along
        dim 0 it spans, then a view of the other dims."""
        info = self.info(key)
        dtype = dtype_from_safetensors(info["dtype"])
        full = info["shape"]
        if (
            len(offsets) != len(full)
            or len(shape) != len(full)
            or any(o < 0 or n < 0 or o + n > m for o, n, m in zip(offsets, shape, full))
        ):
            raise ValueError(
                f"{self.path}: tensor {key} is stored with shape {full}; the slice at offsets {offsets} of "
                f"shape {shape} asked for lies outside it (the file does not hold the tensor expected)"
            )
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
    """Parsed headers of the safetensors files in one folder, opened on first use; a name that
    would lead out of the folder is refused (``also``: other folders its links may reach)."""

    def __init__(self, root: Path, what: str, also: tuple[Path, ...] = ()) -> None:
        self.root, self.what, self.also = root, what, also
        self._open: dict[str, _SafetensorsFile] = {}

    def get(self, rel: str) -> _SafetensorsFile:
        if rel not in self._open:
            self._open[rel] = _SafetensorsFile(confined(self.root, rel, self.what, also=self.also))
        return self._open[rel]


class CheckpointTensors:
    """Global tensors of one of our checkpoints, readable slice by slice."""

    def __init__(self, ckpt_dir: str | Path, manifest: Manifest | None = None) -> None:
        self.root = Path(ckpt_dir)
        self.manifest = manifest or Manifest.load(self.root)
        self._files = _Files(self.root, f"{self.root / MANIFEST}: piece file")
        self._checked: set[tuple[str, str]] = set()

    def names(self, kind: str = "model") -> list[str]:
        return [n for n, t in self.manifest.tensors.items() if t.kind == kind]

    def __contains__(self, name: str) -> bool:
        return name in self.manifest.tensors

    def check_shape(self, name: str, global_shape: list[int]) -> None:
        """Refuse tensor ``name`` for a parameter of shape ``global_shape`` when the checkpoint
        records another global shape."""
        entry = self.manifest.tensors[name]
        if list(global_shape) != list(entry.shape):
            raise ValueError(
                f"{self.root / MANIFEST}: tensor {name} has global shape {entry.shape}, the model's parameter "
                f"{list(global_shape)}; the checkpoint was written for another model configuration"
            )

    def check_pieces(self) -> None:
        """Open every piece's file header now (headers only): a file that does not store its
        pieces as the manifest says is refused before anything is read or written."""
        for name, entry in self.manifest.tensors.items():
            for piece in entry.pieces:
                self._piece_file(name, piece)

    def _piece_file(self, name: str, piece: Piece) -> _SafetensorsFile:
        """The file holding ``piece`` of ``name``, once its header is seen to store that piece
        with the shape and dtype the manifest records."""
        f = self._files.get(piece.file)
        if (piece.file, piece.key) not in self._checked:
            info, entry = f.info(piece.key), self.manifest.tensors[name]
            if list(info["shape"]) != list(piece.shape) or info["dtype"] != safetensors_dtype(
                dtype_from_name(entry.dtype)
            ):
                raise ValueError(
                    f"{f.path}: {piece.key} is stored as {info['dtype']} {info['shape']}, the manifest says "
                    f"{entry.dtype} {piece.shape} for a piece of {name}; run neuron-flows validate {self.root}"
                )
            self._checked.add((piece.file, piece.key))
        return f

    def read(self, name: str, offsets: Ints = None, shape: Ints = None, *, global_shape: Ints = None) -> torch.Tensor:
        """The slice ``[offsets, offsets + shape)`` of global tensor ``name`` (all of it by default).
        ``global_shape``: the shape the caller's tensor has; a checkpoint that records another
        is refused rather than read in part."""
        entry = self.manifest.tensors[name]
        if global_shape is not None:
            self.check_shape(name, global_shape)
        offsets = offsets if offsets is not None else [0] * len(entry.shape)
        shape = shape if shape is not None else list(entry.shape)
        for piece in entry.pieces:  # one piece holds the whole box: return its rows, no copy
            if all(p <= o and o + n <= p + m for o, n, p, m in zip(offsets, shape, piece.offsets, piece.shape)):
                rel = [o - p for o, p in zip(offsets, piece.offsets)]
                return self._piece_file(name, piece).read(piece.key, rel, shape)
        out = torch.empty(shape, dtype=dtype_from_name(entry.dtype))
        covered = 0
        for piece in entry.pieces:
            box = _overlap(offsets, shape, piece.offsets, piece.shape)
            if box is None:
                continue
            lo, size = box
            src = self._piece_file(name, piece).read(piece.key, [l - p for l, p in zip(lo, piece.offsets)], size)
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
            f = self._piece_file(name, piece)
            info = f.info(piece.key)
            row_bytes = math.prod(piece.shape[1:]) * dtype_from_name(entry.dtype).itemsize
            ranges.append((f.path, f.data_start + info["data_offsets"][0], take * row_bytes))
            row += take
        return ranges if row == rows else None

    def pieces(self, name: str) -> list[Piece]:
        return self.manifest.tensors[name].pieces

    def piece_start(self, name: str, piece: Piece) -> int:
        """Offset in its file of the first byte of ``piece`` of ``name`` (the file's header seen to
        store it as the manifest says)."""
        f = self._piece_file(name, piece)
        return f.data_start + f.info(piece.key)["data_offsets"][0]

    def file_path(self, rel: str) -> Path:
        """Where the manifest's file ``rel`` is (a name that leads out of the checkpoint is refused)."""
        return self._files.get(rel).path


class HFWeights:
    """Tensors of a Hugging Face model directory (``model.safetensors`` or a sharded index)."""

    def __init__(self, model_dir: str | Path) -> None:
        self.root = Path(model_dir)
        index = self.root / "model.safetensors.index.json"
        self._files = _Files(self.root, f"{index}: weight_map file", hub_blobs(self.root))
        if index.exists():
            raw = read_json(index)
            self.where = raw.get("weight_map") if isinstance(raw, dict) else None
            if not isinstance(self.where, dict):
                raise ValueError(f"{index}: no weight_map object (tensor name → file name)")
            for rel in set(self.where.values()):  # refused here, before any file is opened
                confined(self.root, rel, self._files.what, also=self._files.also)
        elif (self.root / "model.safetensors").exists():
            header = self._files.get("model.safetensors").header
            self.where = {k: "model.safetensors" for k in header if k != "__metadata__"}
        else:
            raise ValueError(
                f"{self.root} has no model.safetensors or model.safetensors.index.json; "
                "save the model with save_pretrained(safe_serialization=True)"
            )

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def names(self) -> list[str]:
        """Every tensor's name, in the order the index or the file lists them."""
        return list(self.where)

    def shape_dtype(self, name: str) -> tuple[list[int], torch.dtype]:
        """The stored shape and dtype of tensor ``name``, from the file's header."""
        info = self._files.get(self.where[name]).info(name)
        try:
            return list(info["shape"]), dtype_from_safetensors(info["dtype"])
        except KeyError:
            raise ValueError(f"{self.root}: {name} has dtype {info['dtype']}, which this tool does not read") from None

    def check_shape(self, name: str, global_shape: list[int]) -> None:
        """Refuse tensor ``name`` for a parameter of shape ``global_shape`` when the file stores
        another shape."""
        f = self._files.get(self.where[name])
        stored = list(f.info(name)["shape"])
        if list(global_shape) != stored:
            raise ValueError(
                f"{f.path}: tensor {name} is stored with shape {stored}, the model's parameter has shape "
                f"{list(global_shape)}; the weights do not match the model's config.json"
            )

    def byte_range(self, name: str) -> tuple[Path, int, int]:
        """``(file, offset, nbytes)`` of tensor ``name``'s bytes."""
        f = self._files.get(self.where[name])
        start, stop = f.info(name)["data_offsets"]
        return f.path, f.data_start + start, stop - start

    def read(self, name: str, offsets: Ints = None, shape: Ints = None, *, global_shape: Ints = None) -> torch.Tensor:
        """The slice ``[offsets, offsets + shape)`` of tensor ``name`` (all of it by default).
        ``global_shape``: the shape of the parameter it is loaded into; a file that stores
        another shape is refused."""
        if global_shape is not None:
            self.check_shape(name, global_shape)
        f = self._files.get(self.where[name])
        if offsets is None:
            shape = list(f.info(name)["shape"])
            offsets = [0] * len(shape)
        return f.read(name, offsets, shape)
