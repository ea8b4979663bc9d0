"""Atomic, sharded checkpoint save, optionally asynchronous.

Every rank copies the tensors it owns to host memory (the only part that blocks training when
saving asynchronously), then writes them as safetensors into ``checkpoint-<step>.tmp`` together
with a small ``rank_XXXXX.json`` listing its files (size, sha256) and tensor slices. Rank 0 waits
for every rank's listing, writes ``trainer_state.json`` and ``manifest.json``, renames the
folder into place and writes ``COMPLETE`` last. Ranks coordinate through those files rather than
collectives, so the writing can run in a background thread while training's own collectives go
on. A crash at any point leaves the previous checkpoints untouched and at most a folder without
``COMPLETE``, which does not count.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor, Replicate

from ..utils import fsync_path, sha256_file
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

__all__ = ["CheckpointWriter", "sha256_file"]

_RANK_LISTING = "rank_{:05d}.json"


def _owns(t: torch.Tensor, tp_rank: int) -> bool:
    """Whether this rank is the one that stores ``t``: replicas are stored once, by the rank at
    coordinate 0 of every mesh axis the tensor is replicated over."""
    if isinstance(t, DTensor):
        coords = t.device_mesh.get_coordinate()
        return all(c == 0 for c, p in zip(coords, t.placements) if isinstance(p, Replicate))
    return tp_rank == 0


def _stage(named: dict[str, torch.Tensor], tp_rank: int, rel: str, kind: str):
    """Host copies of the tensors this rank stores, with the global slice each one covers."""
    tensors, pieces = {}, []
    for name, t in named.items():
        if not _owns(t, tp_rank):
            continue
        local, gshape, offsets = local_view(t.detach())
        tensors[name] = local.to("cpu", copy=True).contiguous()
        pieces.append(
            [name, kind, gshape, dtype_name(local.dtype), asdict(Piece(rel, name, offsets, list(local.shape)))]
        )
    return tensors, pieces


class CheckpointWriter:
    """Writes checkpoints of one run; ``save`` returns once tensors are on the host when
    ``async_save`` is set, and ``wait`` blocks until the last save is complete."""

    def __init__(
        self,
        run_dir: str | Path,
        *,
        coords: dict[str, int],
        model_dir: str | Path,
        keep: int = 0,
        async_save: bool = False,
        timeout_s: float = 3600.0,
    ) -> None:
        self.run = Path(run_dir)
        self.coords = coords
        self.model_dir = Path(model_dir)
        self.keep = keep
        self.async_save = async_save
        self.timeout_s = timeout_s
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def save(
        self,
        step: int,
        *,
        model: dict[str, torch.Tensor],
        optim: dict[str, torch.Tensor],
        parallel: Any,
        trainer_state: dict[str, Any],
        adapter: dict[str, Any] | None = None,
    ) -> Path:
        """Save checkpoint ``step`` (a collective). ``model`` maps Hugging Face names to this
        rank's parameters, stored by dp rank 0; ``optim`` maps ``<name>.<state>`` to the optimizer
        tensors this dp rank stores. Tensors replicated over tensor-parallel ranks are stored once."""
        self.wait()
        final = self.run / f"checkpoint-{step}"
        tmp = self.run / f"checkpoint-{step}.tmp"
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        _barrier()
        tp, pp, dp = self.coords["tp_rank"], self.coords["pp_rank"], self.coords["dp_rank"]
        staged = []
        if dp == 0:
            staged.append((model_file(tp, pp), *_stage(model, tp, model_file(tp, pp), "model")))
        staged.append((optim_file(tp, pp, dp), *_stage(optim, tp, optim_file(tp, pp, dp), "optim")))
        meta = {
            "parallel": parallel if isinstance(parallel, dict) else asdict(parallel),
            "state": trainer_state,
            "adapter": adapter,
        }
        args = (step, tmp, final, staged, meta)
        if self.async_save:
            self._thread = threading.Thread(target=self._run, args=args, name=f"checkpoint-{step}", daemon=True)
            self._thread.start()
        else:
            self._write(*args)
            _barrier()
        return final

    def wait(self) -> None:
        """Block until the save in flight (if any) is complete; re-raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError("asynchronous checkpoint save failed") from error

    def _run(self, *args) -> None:
        try:
            self._write(*args)
        except BaseException as e:  # surfaced by wait() in the training thread
            self._error = e

    def _write(self, step, tmp: Path, final: Path, staged, meta) -> None:
        files, pieces = {}, []
        for rel, tensors, rank_pieces in staged:
            if not tensors:
                continue
            path = tmp / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            save_file(tensors, str(path), metadata={"format": "pt"})
            fsync_path(path)
            files[rel] = {"size": path.stat().st_size, "sha256": sha256_file(path)}
            pieces += rank_pieces
        listing = tmp / _RANK_LISTING.format(self.rank)
        part = listing.with_suffix(".part")
        part.write_text(json.dumps({"files": files, "pieces": pieces}))
        part.rename(listing)
        if self.rank == 0:
            self._finish(step, tmp, final, meta)

    def _finish(self, step: int, tmp: Path, final: Path, meta) -> None:
        listings = [tmp / _RANK_LISTING.format(r) for r in range(self.world)]
        deadline = time.monotonic() + self.timeout_s
        while not all(p.exists() for p in listings):
            if time.monotonic() > deadline:
                missing = [p.name for p in listings if not p.exists()]
                raise TimeoutError(f"{tmp}: ranks never finished writing ({', '.join(missing[:8])} missing)")
            time.sleep(0.02)
        files: dict[str, Any] = {}
        tensors: dict[str, TensorEntry] = {}
        for path in listings:
            data = json.loads(path.read_text())
            files.update(data["files"])
            for name, kind, gshape, dtype, piece in data["pieces"]:
                entry = tensors.setdefault(name, TensorEntry(shape=gshape, dtype=dtype, kind=kind))
                entry.pieces.append(Piece(**piece))
            path.unlink()
        for name in HF_FILES:
            src = self.model_dir / name
            if src.is_file():
                shutil.copyfile(src, tmp / name)
                files[name] = {"size": (tmp / name).stat().st_size, "sha256": sha256_file(tmp / name)}
        (tmp / TRAINER_STATE).write_text(json.dumps(meta["state"], indent=1))
        files[TRAINER_STATE] = {
            "size": (tmp / TRAINER_STATE).stat().st_size,
            "sha256": sha256_file(tmp / TRAINER_STATE),
        }
        manifest = Manifest(
            step=step,
            parallel=meta["parallel"],
            model_config=json.loads((self.model_dir / "config.json").read_text()),
            files=dict(sorted(files.items())),
            tensors=dict(sorted(tensors.items())),
            adapter=meta["adapter"],
        )
        (tmp / MANIFEST).write_text(manifest.to_json())
        fsync_path(tmp / MANIFEST)
        if final.exists():  # an earlier, incomplete attempt at the same step
            shutil.rmtree(final)
        tmp.rename(final)
        marker = final / (COMPLETE + ".tmp")
        marker.write_text(json.dumps({"step": step}))
        fsync_path(marker)
        marker.rename(final / COMPLETE)
        fsync_path(final)
        if self.keep > 0:
            complete = [c for c in list_checkpoints(self.run) if is_complete(c)]
            for old in complete[: -self.keep]:
                shutil.rmtree(old, ignore_errors=True)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
