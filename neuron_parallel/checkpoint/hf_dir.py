"""Writing a Hugging Face model directory, or a peft adapter directory, from a tensor source.

Weights are streamed: tensor by tensor, in row blocks, so peak memory stays near the largest
tensor rather than the model, or, for a source that can scatter its own files (our checkpoints,
``scatter.py``), in one pass over them. The safetensors package only writes whole dicts held in
memory, which is exactly what streaming must avoid; the file format is a length-prefixed JSON
header followed by raw little-endian bytes, so it is written here directly, with the header
computed up front from the source's plan.

Every directory is claimed first (``output.py``): new, empty, or one neuron-flows wrote before;
weights are written under temporary names and put in place, with an earlier export's files
removed, only once all are written and the source's checks have passed.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from pathlib import Path
from typing import Any, Protocol

import torch

from ..utils import atomic_write, fsync_path
from .dtypes import safetensors_dtype
from .output import staged_output_dir

BLOCK_BYTES = 32 << 20  # rows copied per write: memory stays near this, not the largest tensor
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_WEIGHT_FILES = ("model*.safetensors", "*.index.json", "pytorch_model*.bin")
_MODEL_FILES = ("config.json", "generation_config.json", *_WEIGHT_FILES)
"""What a model directory holds besides the tokenizer, and an adapter directory does not."""


class TensorSource(Protocol):
    """A checkpoint as the streaming writer sees it.

    A source may also offer, and the writer then uses: ``read_rows(name, start, stop)`` (rows
    along dim 0, read in blocks), ``byte_ranges(name)`` (file ranges holding the tensor's bytes
    in order, copied in the kernel; None where there are none), ``verify()`` (refuse damaged
    files, before a ``pytorch`` state dict is built) and ``scatter(places)`` (write every planned
    tensor to its place, ``(file descriptor, offset of its first byte)``, then refuse damaged
    files; the weights stay under temporary names until it returns)."""

    model_config: dict[str, Any]

    def plan(self) -> list[tuple[str, list[int], torch.dtype]]:
        """``(Hugging Face name, shape, dtype)`` of every tensor to write, in writing order."""

    def read(self, name: str) -> torch.Tensor:
        """The whole tensor ``name``, exactly the shape and dtype its plan entry says."""

    def hf_files(self) -> list[Path]:
        """Config, generation config and tokenizer files to copy next to the weights."""


def parse_size(text: str | int) -> int:
    """``"5GB"`` → bytes (decimal units as the Hugging Face tools use; ``GiB`` binary)."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", text, re.IGNORECASE)
    if not m:
        raise ValueError(f"cannot read size {text!r}; write e.g. 500MB, 5GB or 2GiB")
    value, unit = float(m.group(1)), (m.group(2) or "B").upper()
    scale = {
        "B": 1,
        "KB": 1e3,
        "MB": 1e6,
        "GB": 1e9,
        "TB": 1e12,
        "KIB": 2**10,
        "MIB": 2**20,
        "GIB": 2**30,
        "TIB": 2**40,
    }
    return int(value * scale[unit])


def _read_checked(source: TensorSource, name: str, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    t = source.read(name)
    if list(t.shape) != list(shape) or t.dtype != dtype:
        # The header was written from the plan; bytes of another shape would corrupt the file.
        raise ValueError(f"{name}: read {list(t.shape)} {t.dtype}, planned {list(shape)} {dtype}")
    return t


def _blocks(source: TensorSource, name: str, shape: list[int], dtype: torch.dtype, block_bytes: int = BLOCK_BYTES):
    """The tensor in row blocks of about ``block_bytes`` when the source can read rows (ours),
    else whole; either way in the byte order of the full tensor."""
    read_rows = getattr(source, "read_rows", None)
    if read_rows is None or len(shape) == 0:
        yield _read_checked(source, name, shape, dtype)
        return
    row_bytes = max(1, math.prod(shape[1:]) * torch.empty((), dtype=dtype).element_size())
    step = max(1, block_bytes // row_bytes)
    for start in range(0, shape[0], step):
        stop = min(shape[0], start + step)
        t = read_rows(name, start, stop)
        if list(t.shape) != [stop - start, *shape[1:]] or t.dtype != dtype:
            raise ValueError(f"{name}: read rows {start}:{stop} as {list(t.shape)} {t.dtype}, planned {shape} {dtype}")
        yield t


def _copy_ranges(ranges: list[tuple[Path, int, int]], dst_fd: int) -> bool:
    """Append file ranges to ``dst_fd`` with ``copy_file_range``: the kernel moves the bytes (or
    shares extents), nothing passes through this process. False, with nothing written, where the
    file system or platform cannot; the caller then copies through memory."""
    start = os.lseek(dst_fd, 0, os.SEEK_CUR)
    try:
        for path, offset, nbytes in ranges:
            with open(path, "rb", buffering=0) as src:
                while nbytes:
                    n = os.copy_file_range(src.fileno(), dst_fd, nbytes, offset)
                    if n == 0:
                        raise OSError(f"{path}: ends before offset {offset} + {nbytes}")
                    offset, nbytes = offset + n, nbytes - n
    except (OSError, AttributeError):
        os.ftruncate(dst_fd, start)
        os.lseek(dst_fd, start, os.SEEK_SET)
        return False
    return True


def _layout(items) -> tuple[bytes, dict[str, int], int]:
    """The safetensors header of ``items`` (``(name, shape, dtype)``), length prefix included;
    each tensor's offset in the data that follows it; the data's size."""
    header, offsets, offset = {}, {}, 0
    for name, shape, dtype in items:
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": safetensors_dtype(dtype), "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offsets[name] = offset
        offset += nbytes
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw, offsets, offset


def _stream(f, items, source: TensorSource) -> None:
    """Append the tensors ``items`` to ``f`` (unbuffered, so in-kernel copies and writes share
    one file position) in order, from file ranges in the kernel where the source has them."""
    for name, shape, dtype in items:
        ranges = getattr(source, "byte_ranges", lambda _: None)(name)
        if ranges is not None and _copy_ranges(ranges, f.fileno()):
            continue
        for t in _blocks(source, name, shape, dtype):
            # The bytes of a contiguous CPU tensor, as safetensors stores them (little-endian),
            # handed to write() as a buffer rather than copied into a bytes object first.
            view = memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())
            while view:
                view = view[f.write(view) :]
            del t


def write_safetensors(path: Path, items, source: TensorSource) -> int:
    """Write the tensors ``items`` (``(name, shape, dtype)``, a slice of ``source``'s plan) to one
    safetensors file, streamed from ``source``; atomically (a fsynced ``.tmp`` renamed, then the
    folder fsynced). Returns the data bytes."""
    head, _, nbytes = _layout(items)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb", buffering=0) as f:
        f.write(head)
        _stream(f, items, source)
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)
    return nbytes


def _write_weights(source: TensorSource, tmps: list[Path], groups: list[list]) -> None:
    """Each group of tensors to its ``.tmp`` file, fsynced. A source that can scatter (ours) fills
    all files in one pass over its piece files; any other streams them tensor by tensor. On
    failure the ``.tmp`` files are removed."""
    layouts = [_layout(group) for group in groups]
    fds: list[int] = []
    try:
        for tmp, (head, _, _) in zip(tmps, layouts):
            fds.append(os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644))
            os.write(fds[-1], head)  # < 100 MB, one write
        if hasattr(source, "scatter"):
            places = {}
            for fd, group, (head, offsets, nbytes) in zip(fds, groups, layouts):
                os.ftruncate(fd, len(head) + nbytes)  # the whole file exists before it is filled
                for name, _, _ in group:
                    places[name] = (fd, len(head) + offsets[name])
            source.scatter(places)
        else:
            for fd, group in zip(fds, groups):
                with open(fd, "wb", buffering=0, closefd=False) as f:
                    _stream(f, group, source)
        for fd in fds:
            os.fsync(fd)
    except BaseException:
        for tmp in tmps:
            tmp.unlink(missing_ok=True)
        raise
    finally:
        for fd in fds:
            os.close(fd)


def _write_state_dict(source: TensorSource, plan, tmp: Path) -> None:
    """The whole model as one ``torch.save`` file at ``tmp``, fsynced (removed on failure); a
    source that can verify its files does so first, since it is read tensor by tensor."""
    try:
        getattr(source, "verify", lambda: None)()
        state = {name: _read_checked(source, name, shape, dtype) for name, shape, dtype in plan}
        torch.save(state, tmp)
        fsync_path(tmp)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _shard(plan, limit: int) -> list[list]:
    """The plan in consecutive groups of at most ``limit`` bytes (a larger tensor alone)."""
    groups, cur, size = [], [], 0
    for item in plan:
        nbytes = math.prod(item[1]) * item[2].itemsize
        if cur and size + nbytes > limit:
            groups.append(cur)
            cur, size = [], 0
        cur.append(item)
        size += nbytes
    groups.append(cur)
    return groups


def write_hf_dir(
    source: TensorSource, output_dir: str | Path, *, fmt: str = "safetensors", max_shard_size: str | int = "5GB"
) -> Path:
    """Stream ``source`` into a Hugging Face model directory (one tensor in memory at a time for
    safetensors; ``pytorch`` builds one state dict, as ``torch.save`` needs), sharded into files
    of at most ``max_shard_size`` bytes (a larger tensor alone) with an index when there are
    several. The weights are written under temporary names and put in place, replacing an
    earlier export's weights or adapter, only once all are written and their sources checked;
    if anything fails, a directory this call created is removed again."""
    if fmt not in ("safetensors", "pytorch"):
        raise ValueError(f"format {fmt!r} is not one of ('safetensors', 'pytorch')")
    limit = parse_size(max_shard_size)
    plan = source.plan()
    with staged_output_dir(output_dir) as out:  # never a directory of someone else's files
        if fmt == "pytorch":
            names = ["pytorch_model.bin"]
            _write_state_dict(source, plan, out / "pytorch_model.bin.tmp")
        else:
            groups = _shard(plan, limit)
            n = len(groups)
            names = (
                ["model.safetensors"] if n == 1 else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
            )
            _write_weights(source, [out / f"{name}.tmp" for name in names], groups)
        _remove(out, (*_WEIGHT_FILES, ADAPTER_CONFIG, ADAPTER_WEIGHTS))
        for name in names:
            os.replace(out / f"{name}.tmp", out / name)
        if len(names) > 1:
            weight_map = {item[0]: name for name, group in zip(names, groups) for item in group}
            total = sum(math.prod(shape) * dtype.itemsize for _, shape, dtype in plan)
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            atomic_write(out / "model.safetensors.index.json", json.dumps(index, indent=2))
        for src in source.hf_files():
            atomic_write(out / src.name, src.read_bytes())
        fsync_path(out)  # the stale files' removal, and every rename, made durable
    return out


def write_adapter_dir(source: TensorSource, output_dir: str | Path, config: dict[str, Any]) -> Path:
    """Stream ``source`` into a peft adapter directory: :data:`ADAPTER_WEIGHTS` (one safetensors
    file), :data:`ADAPTER_CONFIG` (``config``) and the source's files, nothing else; a model
    directory's files that an earlier export left there are removed once these are written. If
    anything fails, a directory this call created is removed again."""
    with staged_output_dir(output_dir) as out:
        write_safetensors(out / ADAPTER_WEIGHTS, source.plan(), source)
        atomic_write(out / ADAPTER_CONFIG, json.dumps(config, indent=2, sort_keys=True) + "\n")
        for src in source.hf_files():
            atomic_write(out / src.name, src.read_bytes())
        _remove(out, _MODEL_FILES)
        fsync_path(out)
    return out


def _remove(out: Path, patterns: tuple[str, ...]) -> None:
    """Remove the files in ``out`` that match ``patterns`` (an earlier export's)."""
    for pattern in patterns:
        for stale in out.glob(pattern):
            if stale.is_file():
                stale.unlink()
