"""Streaming consolidation: any sharded layout → one Hugging Face model directory.

Tensors are assembled one at a time from memory-mapped pieces and appended to the output file,
so peak memory stays near the largest tensor rather than the model. The safetensors package
only writes whole dicts held in memory, which is exactly what streaming must avoid; the file
format is a length-prefixed JSON header followed by raw little-endian bytes, so it is written
here directly, with the header computed up front from the source's plan.

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
from .output import claim_output_dir
from .tensors import CheckpointTensors, dtype_from_name, safetensors_dtype
from .validate import validate_checkpoint, verify_checksums

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


def write_safetensors(path: Path, items, source: TensorSource) -> int:
    """Write the tensors ``items`` (``(name, shape, dtype)``, a slice of ``source``'s plan) to one
    safetensors file, streamed from ``source``; atomically (a fsynced ``.tmp`` renamed, then the
    folder fsynced). Returns the data bytes."""
    header, offset = {}, 0
    for name, shape, dtype in items:
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": safetensors_dtype(dtype), "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    tmp = path.with_name(path.name + ".tmp")
    # Unbuffered, so in-kernel copies and writes share one file position.
    with open(tmp, "wb", buffering=0) as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
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
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)
    return offset


def open_source(path: str | Path, *, model_dir: str | Path | None = None) -> TensorSource:
    """The checkpoint at ``path`` as a :class:`TensorSource`, after quick validation: ours (a run
    dir, checkpoint dir or its ``shards/``) or an optimum-neuron / neuronx-distributed one (its
    checkpoint dir or ``shards/``; see ``neuronx.py``). Refuses an incomplete or damaged one, and
    one of ours whose files do not have the sha256 its manifest records."""
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
    verify_checksums(ckpt, source.tensors.manifest)
    source.tensors.check_pieces()
    return source


def write_hf_dir(
    source: TensorSource, output_dir: str | Path, *, fmt: str = "safetensors", max_shard_size: str | int = "5GB"
) -> Path:
    """Stream ``source`` into a Hugging Face model directory (one tensor in memory at a time for
    safetensors; ``pytorch`` builds one state dict, as ``torch.save`` needs)."""
    if fmt not in ("safetensors", "pytorch"):
        raise ValueError(f"format {fmt!r} is not one of ('safetensors', 'pytorch')")
    limit = parse_size(max_shard_size)
    plan = source.plan()
    out = claim_output_dir(output_dir)  # never a directory of someone else's files
    for stale in (
        list(out.glob("model*.safetensors")) + list(out.glob("*.index.json")) + list(out.glob("pytorch_model*.bin"))
    ):
        stale.unlink()

    if fmt == "pytorch":
        state = {name: _read_checked(source, name, shape, dtype) for name, shape, dtype in plan}
        tmp = out / "pytorch_model.bin.tmp"
        torch.save(state, tmp)
        fsync_path(tmp)
        os.replace(tmp, out / "pytorch_model.bin")
    else:
        groups, cur, size = [], [], 0
        for item in plan:
            nbytes = math.prod(item[1]) * torch.empty((), dtype=item[2]).element_size()
            if cur and size + nbytes > limit:
                groups.append(cur)
                cur, size = [], 0
            cur.append(item)
            size += nbytes
        groups.append(cur)
        if len(groups) == 1:
            write_safetensors(out / "model.safetensors", groups[0], source)
        else:
            weight_map, total = {}, 0
            for i, group in enumerate(groups, 1):
                fname = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
                total += write_safetensors(out / fname, group, source)
                weight_map.update({name: fname for name, _, _ in group})
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
