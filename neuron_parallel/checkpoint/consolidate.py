"""Streaming consolidation: any sharded layout → one Hugging Face model directory.

Our own checkpoints are written in one pass over each piece file (``scatter.py``): read once,
hashed as read, each piece's bytes sent straight to its place in the output, with memory at a
few read buffers. Other sources are streamed tensor by tensor, in row blocks, so peak memory
stays near the largest tensor rather than the model. The safetensors package only writes whole
dicts held in memory, which is exactly what streaming must avoid; the file format is a
length-prefixed JSON header followed by raw little-endian bytes, so it is written here
directly, with the header computed up front from the source's plan.

Two sources feed the one writer through :class:`TensorSource`: our own checkpoints (manifest and
safetensors pieces) and optimum-neuron / neuronx-distributed checkpoints (``neuronx.py``).
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
from .format import HF_FILES, MANIFEST, Manifest, confined, resolve_checkpoint
from .neuronx import NeuronxCheckpoint
from .neuronx_layout import find_neuronx_checkpoint
from .output import staged_output_dir
from .scatter import Target, scatter_pieces
from .tensors import CheckpointTensors, dtype_from_name, safetensors_dtype
from .validate import check_digest, validate_checkpoint, verify_checksums

BLOCK_BYTES = 32 << 20  # rows copied per write: memory stays near this, not the largest tensor
_VOCAB_PADDED = ("model.embed_tokens.weight", "lm_head.weight")


class TensorSource(Protocol):
    """A checkpoint as the streaming writer sees it."""

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


def _export_plan(tensors: CheckpointTensors) -> list[tuple[str, list[int], torch.dtype]]:
    """(name, exported shape, dtype) of every model tensor, in manifest order; drops the tied
    lm_head and strips rows a vocab-padded embedding added beyond the config's vocab_size."""
    config = tensors.manifest.model_config
    vocab = config.get("vocab_size")
    plan = []
    for name in tensors.names("model"):
        entry = tensors.manifest.tensors[name]
        if name == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue
        shape = list(entry.shape)
        if name in _VOCAB_PADDED and vocab and shape[0] > vocab:
            shape[0] = vocab
        plan.append((name, shape, dtype_from_name(entry.dtype)))
    return plan


class ManifestSource:
    """One of our checkpoints (manifest + safetensors pieces) as a :class:`TensorSource`."""

    def __init__(self, ckpt: Path, model_dir: str | Path | None = None) -> None:
        self.root = ckpt
        self.tensors = CheckpointTensors(ckpt)
        self.model_config = self.tensors.manifest.model_config
        self._plan = _export_plan(self.tensors)
        self._shapes = {name: shape for name, shape, _ in self._plan}
        self._files_dir = Path(model_dir) if model_dir is not None else ckpt

    def plan(self) -> list[tuple[str, list[int], torch.dtype]]:
        return self._plan

    def read(self, name: str) -> torch.Tensor:
        shape = self._shapes[name]
        return self.tensors.read(name, [0] * len(shape), shape)

    def byte_ranges(self, name: str) -> list[tuple[Path, int, int]] | None:
        """File ranges holding the exported tensor's bytes in order, when its pieces are whole rows."""
        shape = self._shapes[name]
        return self.tensors.byte_ranges(name, shape[0]) if shape else None

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` (along dim 0) of the exported tensor."""
        shape = self._shapes[name]
        return self.tensors.read(name, [start] + [0] * (len(shape) - 1), [stop - start, *shape[1:]])

    def hf_files(self) -> list[Path]:
        if self._files_dir != self.root:  # the user's own model directory
            return [self._files_dir / n for n in HF_FILES if (self._files_dir / n).is_file()]
        what = f"{self.root / MANIFEST}: model file"
        return [p for n in HF_FILES if (p := confined(self.root, n, what)).is_file()]

    def read_files(self) -> list[str]:
        """The manifest's files that exporting reads: those holding pieces of the exported
        tensors, and the config and tokenizer files copied from the checkpoint."""
        pieces = {p.file for name in self._shapes for p in self.tensors.pieces(name)}
        copied = {p.name for p in self.hf_files()} if self._files_dir == self.root else set()
        return sorted(pieces | (copied & set(self.tensors.manifest.files)))

    def verify(self) -> None:
        """Refuse the checkpoint unless every file exporting reads has its recorded sha256 (for
        writers that read tensor by tensor; :meth:`scatter` hashes as it copies)."""
        verify_checksums(self.root, self.tensors.manifest, self.read_files())

    def scatter(self, targets: dict[str, Target]) -> None:
        """Write every planned tensor to its target in one pass over each piece file (see
        ``scatter.py``), then refuse the checkpoint if a file read does not have its recorded
        sha256: the caller keeps the targets out of place until this returns."""
        digests = scatter_pieces(self.tensors, targets)
        for rel, digest in sorted(digests.items()):
            check_digest(self.root, self.tensors.file_path(rel), digest, self.tensors.manifest.files[rel]["sha256"])


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
            targets = {}
            for fd, group, (head, offsets, nbytes) in zip(fds, groups, layouts):
                os.ftruncate(fd, len(head) + nbytes)  # the whole file exists before it is filled
                for name, shape, dtype in group:
                    targets[name] = Target(fd, len(head) + offsets[name], tuple(shape), dtype.itemsize)
            source.scatter(targets)
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


def open_source(path: str | Path, *, model_dir: str | Path | None = None) -> TensorSource:
    """The checkpoint at ``path`` as a :class:`TensorSource`, after quick validation: ours (a run
    dir, checkpoint dir or its ``shards/``) or an optimum-neuron / neuronx-distributed one (its
    checkpoint dir or ``shards/``; see ``neuronx.py``). Refuses an incomplete or damaged one, and
    one of ours whose config or tokenizer files do not have the sha256 its manifest records (its
    piece files are hashed as the export reads them: :meth:`ManifestSource.scatter`)."""
    shards = find_neuronx_checkpoint(path)
    if shards is not None:
        return NeuronxCheckpoint(shards, model_dir=model_dir)
    ckpt = resolve_checkpoint(path)
    # Structure only: files, sizes, coverage. The model-shape check imports transformers and
    # builds the model on meta, seconds and ~70 MB that streaming itself does not need.
    problems = validate_checkpoint(ckpt, quick=True, check_model=False)
    if problems:
        raise ValueError(f"refusing to consolidate {ckpt}: " + "; ".join(problems))
    source = ManifestSource(ckpt, model_dir)
    source.tensors.check_pieces()
    # The config and tokenizer files now; the piece files are hashed as the export reads them.
    verify_checksums(ckpt, source.tensors.manifest, [f for f in source.read_files() if f in {*HF_FILES}])
    return source


def write_hf_dir(
    source: TensorSource, output_dir: str | Path, *, fmt: str = "safetensors", max_shard_size: str | int = "5GB"
) -> Path:
    """Stream ``source`` into a Hugging Face model directory (one tensor in memory at a time for
    safetensors; ``pytorch`` builds one state dict, as ``torch.save`` needs). The weights are
    written under temporary names and put in place, replacing an earlier export's, only once
    all are written and their sources checked; if anything fails, a directory this call
    created is removed again."""
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
        stale = ("model*.safetensors", "*.index.json", "pytorch_model*.bin")
        for old in [p for pattern in stale for p in out.glob(pattern)]:
            old.unlink()
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


def consolidate_checkpoint(
    path: str | Path,
    output_dir: str | Path,
    *,
    fmt: str = "safetensors",
    max_shard_size: str | int = "5GB",
    model_dir: str | Path | None = None,
    merge: bool = False,
    base_dir: str | Path | None = None,
) -> Path:
    """Write a Hugging Face model directory for the checkpoint at ``path``: ours (a run dir → its
    newest complete checkpoint, a checkpoint dir, or its ``shards/`` folder) or an optimum-neuron
    / neuronx-distributed one (its checkpoint dir or ``shards/``). Refuses a checkpoint that
    fails quick validation. ``model_dir``: a Hugging Face directory whose config, generation
    config and tokenizer files are copied instead of the checkpoint's own.

    A LoRA checkpoint becomes a peft adapter directory, or with ``merge`` the base model with the
    adapters merged in (``base_dir``: the base model, default the one its manifest records); see
    ``adapter.py``. ``merge`` is refused for a full fine-tuning checkpoint."""
    if _is_lora_checkpoint(path):
        from .adapter import export_adapter, merge_adapter  # adapter.py builds on this module's writer

        if merge:
            return merge_adapter(
                path, output_dir, base_dir, fmt=fmt, max_shard_size=max_shard_size, model_dir=model_dir
            )
        if base_dir is not None:
            raise ValueError("a base model directory is only read when merging; add --merge (merge=True)")
        return export_adapter(path, output_dir, model_dir=model_dir)
    source = open_source(path, model_dir=model_dir)
    if merge or base_dir is not None:
        raise ValueError(
            f"{path} is not a LoRA checkpoint: there are no adapters to merge; consolidate it without "
            "--merge (and --base-dir), which writes the whole fine-tuned model"
        )
    return write_hf_dir(source, output_dir, fmt=fmt, max_shard_size=max_shard_size)


def _is_lora_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is one of our checkpoints whose manifest records adapters (an unreadable
    one is not, and is refused with its problems by ``open_source``)."""
    if find_neuronx_checkpoint(path) is not None:
        return False
    try:
        return Manifest.load(resolve_checkpoint(path)).adapter is not None
    except (OSError, ValueError, KeyError):
        return False
