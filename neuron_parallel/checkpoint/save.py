"""Atomic, sharded checkpoint save, optionally asynchronous.

Every rank copies the tensors it owns to host memory (the only part that blocks training when
saving asynchronously), then writes them as safetensors into ``checkpoint-<step>.tmp`` together
with a small ``rank_XXXXX.json`` listing its files (size, sha256) and tensor slices. Rank 0 waits
for every rank's listing, writes ``trainer_state.json`` and ``manifest.json``, renames the
folder into place and writes ``COMPLETE`` last. Ranks coordinate through those files rather than
collectives, so the writing can run in a background thread while training's own collectives go
on. A crash at any point leaves the previous checkpoints untouched and at most a folder without
``COMPLETE``, which does not count.

A write that fails (a full disk, a file over the size limit) must stop every rank, not only the
one that saw it: while a save is in flight the training thread calls ``check`` at every step that
logs, and ``wait`` before the next save begins; there the ranks agree through one small all-reduce
whether any rank failed, and all raise ``CheckpointSaveFailed`` together. Between those points
nothing here reads a value back from the device. Every file and folder is fsynced before the
name that makes it count (the rename into place, then ``COMPLETE``) is written.
"""

from __future__ import annotations

import errno
import json
import os
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

from ..parallel.dtensor import local_view
from ..utils import atomic_write, fsync_path, read_json, sha256_file
from .dtypes import dtype_name
from .format import (
    COMPLETE,
    MANIFEST,
    TRAINER_STATE,
    Manifest,
    Piece,
    TensorEntry,
    checkpoint_step,
    is_complete,
    list_checkpoints,
    model_file,
    optim_file,
    user_model_files,
)
from .output import check_output_dir, claim_output_dir

__all__ = ["CheckpointSaveFailed", "CheckpointWriter", "sha256_file"]

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


class CheckpointSaveFailed(RuntimeError):
    """A checkpoint could not be written on some rank. Raised on every rank at the same point
    (the ranks agree on it), naming the checkpoint, each rank's error and what to do."""


class _Cancelled(Exception):
    """Rank 0's finishing of a save that another rank failed was called off."""


class CheckpointWriter:
    """Writes checkpoints of one run; ``save`` returns once tensors are on the host when
    ``async_save`` is set, ``check`` (at the steps that log) stops every rank once any rank's
    write failed, and ``wait`` blocks until the last save is complete on every rank. ``timeout_s``
    bounds rank 0's wait for the other ranks' parts (``launch.timeout_s``); ``device`` is where
    the small tensors of the ranks' agreement live (the backend's device)."""

    def __init__(
        self,
        run_dir: str | Path,
        *,
        coords: dict[str, int],
        model_dir: str | Path,
        keep: int = 0,
        async_save: bool = False,
        timeout_s: float = 1800.0,
        device: torch.device | str = "cpu",
    ) -> None:
        self.run = Path(run_dir)
        self.coords = coords
        self.model_dir = Path(model_dir)
        self.keep = keep
        self.async_save = async_save
        self.timeout_s = timeout_s
        self.device = torch.device(device)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._step: int | None = None  # the save not yet known complete on every rank
        self._cancel = threading.Event()
        self._written = threading.Event()  # this rank's part of the save in flight is written (or failed)

    def remove_partial(self) -> list[str]:
        """On rank 0, delete the ``checkpoint-<step>.tmp`` folders of saves cut short (they never
        count, and a save of the same step would replace them); the names removed. Call it
        before the first save. A run directory neuron-flows did not create is refused
        (``output.py``): its folders may be another tool's."""
        if self.rank != 0 or not self.run.is_dir():
            return []
        check_output_dir(self.run)
        removed = []
        for tmp in sorted(self.run.glob("checkpoint-*.tmp")):
            if tmp.is_dir() and checkpoint_step(tmp.with_suffix("")) is not None:
                shutil.rmtree(tmp, ignore_errors=True)
                removed.append(tmp.name)
        if removed:
            fsync_path(self.run)
        return removed

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
        tensors this dp rank stores. Tensors replicated over tensor-parallel ranks are stored once.
        Raises ``CheckpointSaveFailed`` on every rank if this save (or, when asynchronous, the
        one before) failed on any rank."""
        self.wait()
        final = self.run / f"checkpoint-{step}"
        tmp = self.run / f"checkpoint-{step}.tmp"
        self._step = step
        error = None
        if self.rank == 0:
            try:
                claim_output_dir(self.run)  # never a folder of another tool's checkpoints
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)
            except (OSError, ValueError) as e:
                error = e
        self._agree(error, pending=False)  # also the barrier: tmp exists before any rank writes
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
        self._error = None
        self._cancel.clear()
        self._written.clear()
        self._thread = threading.Thread(
            target=self._run, args=(step, tmp, final, staged, meta), name=f"checkpoint-{step}", daemon=True
        )
        self._thread.start()
        if not self.async_save:
            self.wait()
        return final

    def check(self) -> None:
        """Call on every rank at the same steps (the trainer's log steps): while a save is in
        flight, the ranks agree (a small all-reduce, read back) whether any rank's write failed,
        and all raise ``CheckpointSaveFailed`` if so. Free when no save is in flight."""
        if self._step is not None:
            self._poll()

    def wait(self) -> None:
        """Block until the save in flight (if any) is complete on every rank (a collective);
        raise ``CheckpointSaveFailed`` on every rank if it failed on any. The ranks agree twice,
        however long the write takes: once every rank has written its part (or given up after
        ``timeout_s``), so that rank 0 stops waiting for a part that failed, and once rank 0 has
        finished the checkpoint."""
        if self._step is None:
            return
        if self._written.wait(timeout=self.timeout_s):
            error = self._error
        else:
            error = TimeoutError(
                f"this rank's part of checkpoint-{self._step} was not written within "
                f"launch.timeout_s={self.timeout_s:g} s"
            )
        self._agree(error, pending=False)
        if self._thread is not None:
            self._thread.join()
        self._agree(self._error, pending=False)
        self._thread, self._step = None, None

    def _poll(self) -> None:
        # Whether the thread is alive is read before its error: a thread seen finished has set
        # any error it will ever set.
        alive = self._thread is not None and self._thread.is_alive()
        if self._agree(self._error, pending=alive):
            self._thread, self._step = None, None

    def _agree(self, error: BaseException | None, *, pending: bool) -> bool:
        """What every rank knows about the save in flight: raises ``CheckpointSaveFailed`` on
        every rank if any rank has an error; else whether no rank is still writing."""
        flags = torch.tensor([float(error is not None), float(pending)], device=self.device)
        if self.world > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        failed, still_writing = flags.tolist()
        if failed:
            self._fail(error)
        return not still_writing

    def _fail(self, error: BaseException | None) -> None:
        mine = None if error is None else _describe(error)
        errors = [mine]
        if self.world > 1:
            errors = [None] * self.world
            dist.all_gather_object(errors, mine)
        self._cancel.set()  # rank 0 stops waiting for parts that will never come
        step, self._thread, self._step, self._error = self._step, None, None, None
        raise CheckpointSaveFailed(self._failure_message(step, errors)) from error

    def _failure_message(self, step: int, errors: list[str | None]) -> str:
        failed = "; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e)
        previous = [c for c in list_checkpoints(self.run) if is_complete(c) and checkpoint_step(c) < step]
        resume = (
            f"it resumes from {previous[-1].name}, which is intact"
            if previous
            else "no earlier checkpoint is complete, so it starts again from step 0"
        )
        if any(reason in failed for reason in _DISK_FULL):
            fix = f"free disk space where {self.run} lives (or lift the file size limit)"
        else:
            fix = "fix the cause above"
        return (
            f"checkpoint-{step} could not be saved in {self.run}: {failed}. Training stopped; "
            f"checkpoint-{step} is incomplete and will never be resumed from. To continue, {fix}, then run "
            f"again: {resume}."
        )

    def _run(self, step, tmp: Path, final: Path, staged, meta) -> None:
        # What fails here is agreed on by the ranks in check() / wait(), in the training thread.
        try:
            self._write(tmp, staged)
        except BaseException as e:
            self._error = e
        finally:
            self._written.set()
        if self.rank == 0 and self._error is None:
            try:
                self._finish(step, tmp, final, meta)
            except BaseException as e:
                self._error = e

    def _write(self, tmp: Path, staged) -> None:
        """This rank's part: its tensor files, then its listing of them."""
        files, pieces = {}, []
        for rel, tensors, rank_pieces in staged:
            if not tensors:
                continue
            path = tmp / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            save_file(tensors, str(path), metadata={"format": "pt"})
            fsync_path(path)
            for folder in path.relative_to(tmp).parents:  # shards/..., shards/, then tmp itself
                fsync_path(tmp / folder)
            files[rel] = {"size": path.stat().st_size, "sha256": sha256_file(path)}
            pieces += rank_pieces
        listing = tmp / _RANK_LISTING.format(self.rank)
        part = listing.with_suffix(".part")
        part.write_text(json.dumps({"files": files, "pieces": pieces}))
        part.rename(listing)

    def _await_listings(self, step: int, tmp: Path) -> list[Path]:
        """Every rank's listing of its part, waiting at most ``timeout_s`` for them."""
        listings = [tmp / _RANK_LISTING.format(r) for r in range(self.world)]
        deadline = time.monotonic() + self.timeout_s
        while not all(p.exists() for p in listings):
            if self._cancel.is_set():
                raise _Cancelled(f"checkpoint-{step}")
            if time.monotonic() > deadline:
                missing = [r for r, p in enumerate(listings) if not p.exists()]
                raise TimeoutError(
                    f"rank(s) {', '.join(map(str, missing[:16]))}{' ...' if len(missing) > 16 else ''} never "
                    f"reported their part of checkpoint-{step} (no {listings[missing[0]].name} in {tmp}) within "
                    f"launch.timeout_s={self.timeout_s:g} s"
                )
            self._cancel.wait(0.02)
        return listings

    def _finish(self, step: int, tmp: Path, final: Path, meta) -> None:
        files: dict[str, Any] = {}
        tensors: dict[str, TensorEntry] = {}
        for path in self._await_listings(step, tmp):
            data = json.loads(path.read_text())
            files.update(data["files"])
            for name, kind, gshape, dtype, piece in data["pieces"]:
                entry = tensors.setdefault(name, TensorEntry(shape=gshape, dtype=dtype, kind=kind))
                entry.pieces.append(Piece(**piece))
            path.unlink()
        for src in user_model_files(self.model_dir):  # none a link leading out of the model folder
            name = src.name
            shutil.copyfile(src, tmp / name)
            fsync_path(tmp / name)
            files[name] = {"size": (tmp / name).stat().st_size, "sha256": sha256_file(tmp / name)}
        atomic_write(tmp / TRAINER_STATE, json.dumps(meta["state"], indent=1))
        files[TRAINER_STATE] = {
            "size": (tmp / TRAINER_STATE).stat().st_size,
            "sha256": sha256_file(tmp / TRAINER_STATE),
        }
        manifest = Manifest(
            step=step,
            parallel=meta["parallel"],
            model_config=read_json(self.model_dir / "config.json"),
            files=dict(sorted(files.items())),
            tensors=dict(sorted(tensors.items())),
            adapter=meta["adapter"],
        )
        atomic_write(tmp / MANIFEST, manifest.to_json())  # fsyncs tmp too: every name in it is durable
        if self._cancel.is_set():
            raise _Cancelled(f"checkpoint-{step}")
        if final.exists():  # an earlier, incomplete attempt at the same step, in this run's own directory
            shutil.rmtree(final)
        tmp.rename(final)
        fsync_path(self.run)
        atomic_write(final / COMPLETE, json.dumps({"step": step}))  # last, and durable before it counts
        if self.keep > 0:
            complete = [c for c in list_checkpoints(self.run) if is_complete(c)]
            for old in complete[: -self.keep]:
                shutil.rmtree(old, ignore_errors=True)
            fsync_path(self.run)


def _describe(error: BaseException) -> str:
    """One line for an error: its type and message (an OSError's includes the file)."""
    return f"{type(error).__name__}: {error}".splitlines()[0]


_DISK_FULL = tuple(os.strerror(code) for code in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT))
"""How the OS words a full disk, a file over the size limit and an exhausted quota."""
