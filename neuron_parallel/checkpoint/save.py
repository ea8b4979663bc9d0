"""Atomic, sharded checkpoint save (a collective over every rank).

Every rank writes the safetensors files it owns into ``checkpoint-<step>.tmp``; rank 0 gathers
their sizes, checksums and tensor slices, writes ``trainer_state.json`` and ``manifest.json``,
renames the folder into place and writes ``COMPLETE`` last. A crash at any point leaves either
the previous checkpoints untouched or a folder without ``COMPLETE``, which does not count.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor, Replicate

from .format import (
    COMPLETE,
    HF_FILES,
    MANIFEST,
    TRAINER_STATE,
    Manifest,
    Piece,
    TensorEntry,
    is_complete,
    list_checkpoints,
    model_file,
    optim_file,
)
from .tensors import dtype_name, local_view


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _owns(t: torch.Tensor, tp_rank: int) -> bool:
    """Whether this rank is the one that stores ``t``: replicas are stored once, by the rank at
    coordinate 0 of every mesh axis the tensor is replicated over."""
    if isinstance(t, DTensor):
        coords = t.device_mesh.get_coordinate()
        return all(c == 0 for c, p in zip(coords, t.placements) if isinstance(p, Replicate))
    return tp_rank == 0


def _write_file(
    root: Path, rel: str, named: dict[str, torch.Tensor], kind: str, tp_rank: int
) -> tuple[dict[str, Any], list[tuple[str, str, list[int], str, Piece]]] | None:
    tensors, pieces = {}, []
    for name, t in named.items():
        if not _owns(t, tp_rank):
            continue
        local, gshape, offsets = local_view(t.detach())
        tensors[name] = local.to("cpu").contiguous()
        pieces.append((name, kind, gshape, dtype_name(local.dtype), Piece(rel, name, offsets, list(local.shape))))
    if not tensors:
        return None
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata={"format": "pt"})
    _fsync(path)
    return {rel: {"size": path.stat().st_size, "sha256": sha256_file(path)}}, pieces


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    *,
    model: dict[str, torch.Tensor],
    optim: dict[str, torch.Tensor],
    coords: dict[str, int],
    parallel: Any,
    model_dir: str | Path,
    trainer_state: dict[str, Any],
    keep: int = 0,
) -> Path:
    """Save this rank's part of checkpoint ``step``; returns the final folder on every rank.

    ``model`` maps Hugging Face names to this rank's parameters (DTensor or plain); it is stored
    by dp rank 0 only. ``optim`` maps ``<name>.<state>`` to the optimizer tensors this dp rank
    stores (everything on dp rank 0 without ZeRO-1, its own partition with ZeRO-1). Tensors
    replicated over tensor-parallel ranks are stored once.
    """
    run = Path(run_dir)
    final = run / f"checkpoint-{step}"
    tmp = run / f"checkpoint-{step}.tmp"
    rank = dist.get_rank() if dist.is_initialized() else 0
    tp_rank, pp_rank, dp_rank = coords["tp_rank"], coords["pp_rank"], coords["dp_rank"]
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()

    files: dict[str, Any] = {}
    pieces: list = []
    jobs = []
    if dp_rank == 0:
        jobs.append((model_file(tp_rank, pp_rank), model, "model"))
    jobs.append((optim_file(tp_rank, pp_rank, dp_rank), optim, "optim"))
    for rel, named, kind in jobs:
        written = _write_file(tmp, rel, named, kind, tp_rank)
        if written:
            files.update(written[0])
            pieces.extend(written[1])

    gathered: list = [None] * (dist.get_world_size() if dist.is_initialized() else 1)
    if dist.is_initialized():
        dist.all_gather_object(gathered, (files, pieces))
    else:
        gathered = [(files, pieces)]

    if rank == 0:
        _finish(run, tmp, final, step, gathered, parallel, Path(model_dir), trainer_state, keep)
    _barrier()
    return final


def _finish(run, tmp, final, step, gathered, parallel, model_dir, trainer_state, keep) -> None:
    files: dict[str, Any] = {}
    tensors: dict[str, TensorEntry] = {}
    for rank_files, rank_pieces in gathered:
        files.update(rank_files)
        for name, kind, gshape, dtype, piece in rank_pieces:
            entry = tensors.setdefault(name, TensorEntry(shape=gshape, dtype=dtype, kind=kind))
            entry.pieces.append(piece)
    for name in HF_FILES:
        src = model_dir / name
        if src.is_file():
            shutil.copyfile(src, tmp / name)
            files[name] = {"size": (tmp / name).stat().st_size, "sha256": sha256_file(tmp / name)}
    (tmp / TRAINER_STATE).write_text(json.dumps(trainer_state, indent=1))
    files[TRAINER_STATE] = {"size": (tmp / TRAINER_STATE).stat().st_size, "sha256": sha256_file(tmp / TRAINER_STATE)}
    config = json.loads((model_dir / "config.json").read_text())
    manifest = Manifest(
        step=step,
        parallel=asdict(parallel) if not isinstance(parallel, dict) else parallel,
        model_config=config,
        files=dict(sorted(files.items())),
        tensors=dict(sorted(tensors.items())),
    )
    (tmp / MANIFEST).write_text(manifest.to_json())
    _fsync(tmp / MANIFEST)
    if final.exists():  # an earlier, incomplete attempt at the same step
        shutil.rmtree(final)
    tmp.rename(final)
    marker = final / (COMPLETE + ".tmp")
    marker.write_text(json.dumps({"step": step}))
    _fsync(marker)
    marker.rename(final / COMPLETE)
    _fsync(final)
    if keep > 0:
        complete = [c for c in list_checkpoints(run) if is_complete(c)]
        for old in complete[:-keep]:
            shutil.rmtree(old, ignore_errors=True)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
