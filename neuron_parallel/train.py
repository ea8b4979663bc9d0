"""The training entry point torchrun starts in every rank.

    torchrun --nproc_per_node N -m neuron_parallel.train RUN_DIR/job.json

Resumes from the newest complete checkpoint in the run directory (or ``train.resume_from``),
trains to ``train.max_steps``, writes ``metrics.jsonl`` (rank 0, one object per optimizer step)
and checkpoints every ``train.save_every`` steps. Progress goes to stdout as one JSON object per
line prefixed with ``EVENT_PREFIX``, which the launcher turns into progress events.

One optimizer step always consumes ``train.global_batch_size`` sequences (:data:`BATCH_RULE`);
the start event and every checkpoint's ``trainer_state.json`` state the numbers behind it.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from .checkpoint import CheckpointTensors, CheckpointWriter
from .checkpoint.engine_state import load_engine_state, model_tensors, optim_tensors
from .checkpoint.resume import find_resume_checkpoint
from .config import JobConfig
from .data import BlockStream
from .engine import Engine, build_engine
from .memprof import RankMemoryProbe
from .mesh import ParallelDims, close_distributed, exit_rank, init_distributed, local_device
from .optim import lr_at
from .planning.layout import check_layout
from .planning.memory import ModelShape, job_rank_memory
from .utils import write_line

EVENT_PREFIX = "@@neuron-flows "
FAIL_AFTER_ENV = "NEURON_FLOWS_FAIL_AFTER_STEP"
"""Failure injection for tests: every rank exits with status 3 right after the checkpoint of this
step is complete (see :func:`fail_after_checkpoint`)."""
BATCH_RULE = (
    "global_batch_size = micro_batch_size × dp × grad_accum, fixed by train.global_batch_size whatever the layout"
)
_LR_FIELDS = ("lr", "warmup_steps", "lr_schedule", "min_lr_ratio", "max_steps")

CheckpointHook = Callable[["Trainer", int], None]
"""Called on every rank as ``hook(trainer, step)`` once the checkpoint of ``step`` is written
(or, with ``train.async_save``, handed to the background writer)."""


def emit(event: str, **fields) -> None:
    """A structured progress line on stdout (rank 0 only)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        write_line(EVENT_PREFIX + json.dumps({"event": event, **fields}))


def batch_layout(job: JobConfig) -> dict:
    """The numbers of the batch rule for this job, and the rule itself."""
    return {
        "global_batch_size": job.global_batch_size,
        "micro_batch_size": job.train.micro_batch_size,
        "dp": job.parallel.dp,
        "grad_accum": job.grad_accum,
        "batch_rule": BATCH_RULE,
    }


def fail_after_checkpoint(fail_step: int) -> CheckpointHook:
    """A hook that ends every rank with status 3 right after the checkpoint of ``fail_step`` is
    complete on disk (after ``writer.wait()`` and a barrier), emitting ``failure_injected``. A
    run resumed past that step never reaches it, so it does not fail again."""

    def hook(trainer: Trainer, step: int) -> None:
        if step == fail_step:
            trainer.writer.wait()
            dist.barrier()
            emit("failure_injected", step=step)
            os._exit(3)

    return hook


def _hooks_from_env() -> list[CheckpointHook]:
    fail_after = int(os.environ.get(FAIL_AFTER_ENV, "0") or 0)
    return [fail_after_checkpoint(fail_after)] if fail_after else []


def _phase(probe: RankMemoryProbe | None, name: str):
    return probe.phase(name) if probe else contextlib.nullcontext()


@dataclass
class Trainer:
    """One rank's training loop over an already built (and, if resuming, loaded) engine."""

    job: JobConfig
    engine: Engine
    stream: BlockStream
    dims: ParallelDims
    writer: CheckpointWriter
    metrics_path: Path
    probe: RankMemoryProbe | None = None
    after_checkpoint: list[CheckpointHook] = field(default_factory=list)

    @property
    def dp_rank(self) -> int:
        return self.dims.coordinates()["dp_rank"]

    @property
    def tokens_per_step(self) -> int:
        return self.job.global_batch_size * self.job.block_size

    def run(self, start_step: int) -> None:
        """Optimizer steps ``start_step + 1 .. train.max_steps``, then wait for the last save."""
        tc = self.job.train
        t_start = time.perf_counter()
        for step in range(start_step + 1, tc.max_steps + 1):
            record = self.train_step(step)
            record["elapsed_s"] = time.perf_counter() - t_start
            if dist.get_rank() == 0:
                with self.metrics_path.open("a") as f:
                    f.write(json.dumps(record) + "\n")
            if step % tc.log_every == 0 or step == tc.max_steps:
                emit("step", max_steps=tc.max_steps, **record)
            if (tc.save_every and step % tc.save_every == 0) or step == tc.max_steps:
                self.checkpoint(step, record)
        with _phase(self.probe, "save"):
            self.writer.wait()

    def train_step(self, step: int) -> dict:
        """One optimizer step over ``global_batch_size`` sequences: this dp rank's share, in
        ``grad_accum`` micro-batches. Returns the step's metrics record (loss averaged over dp)."""
        job, tc, dp = self.job, self.job.train, self.dims.dp
        t0 = time.perf_counter()
        torch.manual_seed(tc.seed * 100_003 + step)
        mbs, base = tc.micro_batch_size, (step - 1) * job.global_batch_size
        loss_sum = torch.zeros((), device=self.engine.device)
        for a in range(job.grad_accum):
            inputs, labels = self.stream.batch(base + a * mbs * dp + self.dp_rank * mbs, mbs)
            loss_sum += self.engine.forward_backward(inputs, labels, 1.0 / job.grad_accum)
        grad_norm = self.engine.reduce_and_clip()
        lr = lr_at(step, tc)
        self.engine.optimizer_step(lr)
        loss = loss_sum / job.grad_accum
        dist.all_reduce(loss, group=self.dims.mesh["dp"].get_group())
        dt = time.perf_counter() - t0
        return {
            "step": step,
            "loss": loss.item() / dp,
            "lr": lr,
            "grad_norm": grad_norm.item(),
            "tokens_per_s": self.tokens_per_step / dt,
            "tokens_seen": step * self.tokens_per_step,
            "step_time_s": dt,
        }

    def checkpoint(self, step: int, record: dict) -> None:
        """Save the checkpoint of ``step``, emit a ``checkpoint`` event, run the hooks."""
        t_save = time.perf_counter()
        with _phase(self.probe, "save"):
            path = self.writer.save(
                step,
                model=model_tensors(self.engine),
                optim=optim_tensors(self.engine, self.dp_rank),
                parallel=self.job.parallel,
                trainer_state=self.trainer_state(step, record),
            )
        blocked = time.perf_counter() - t_save
        emit("checkpoint", step=step, path=str(path), blocked_s=blocked, async_save=self.job.train.async_save)
        for hook in self.after_checkpoint:
            hook(self, step)

    def trainer_state(self, step: int, record: dict) -> dict:
        """The run record stored with the checkpoint of ``step``."""
        tc, G = self.job.train, self.job.global_batch_size
        return {
            "step": step,
            "tokens_seen": step * self.tokens_per_step,
            "samples_seen": step * G,
            **batch_layout(self.job),
            "lr": record["lr"],
            "lr_schedule": {k: getattr(tc, k) for k in _LR_FIELDS},
            "seed": tc.seed,
            "rng": "per-step torch seed = seed * 100003 + step; data order from (seed, epoch)",
            "metrics": record,
        }


def run_training(job: JobConfig, after_checkpoint: list[CheckpointHook] | None = None) -> None:
    """Train ``job`` on this rank (inside torchrun); ``after_checkpoint`` hooks run after every
    checkpoint (see :data:`CheckpointHook`)."""
    check_layout(job)  # a layout the model cannot take fails here, before any rank loads weights
    init_distributed(job.device)
    pc = job.parallel
    dims = ParallelDims(dp=pc.dp, pp=pc.pp, tp=pc.tp, device_type=job.device)
    run_dir = Path(job.output_dir)
    probe = RankMemoryProbe(job.device, exclude=("save", "load")) if job.train.profile_memory else None
    with probe or contextlib.nullcontext():
        trainer, start_step = _prepare(job, dims, run_dir, probe, list(after_checkpoint or ()))
        trainer.run(start_step)
    if probe:
        _report_memory(probe, job, run_dir)
    dist.barrier()
    emit("done", step=job.train.max_steps, run_dir=str(run_dir))
    close_distributed()


def _prepare(job: JobConfig, dims: ParallelDims, run_dir: Path, probe, hooks) -> tuple[Trainer, int]:
    """Build the engine, restore the newest checkpoint if any, and announce the start."""
    tc = job.train
    metrics_path = run_dir / "metrics.jsonl"
    torch.manual_seed(tc.seed)
    stream = BlockStream(job.dataset_path, seed=tc.seed)
    engine = build_engine(job, dims, local_device(job.device))
    start_step = _resume(job, engine, run_dir, probe)
    if dist.get_rank() == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        _truncate_metrics(metrics_path, start_step)
    pc = job.parallel
    layout = {"tp": pc.tp, "pp": pc.pp, "zero_1": pc.zero_1, **batch_layout(job)}
    emit("start", step=start_step, max_steps=tc.max_steps, world_size=dims.world_size, **layout)
    writer = CheckpointWriter(
        run_dir, coords=dims.coordinates(), model_dir=job.model_path, keep=tc.keep_checkpoints, async_save=tc.async_save
    )
    return Trainer(job, engine, stream, dims, writer, metrics_path, probe, hooks), start_step


def _resume(job: JobConfig, engine: Engine, run_dir: Path, probe) -> int:
    """Load the checkpoint rank 0 picks (warning about any it skipped); the step it was at, or 0."""
    found = find_resume_checkpoint(run_dir, job.train.resume_from) if dist.get_rank() == 0 else (None, [])
    shared = [str(found[0]) if found[0] else None, found[1]]
    dist.broadcast_object_list(shared, src=0)
    for why in shared[1]:
        emit("warning", message=why)
    if not shared[0]:
        return 0
    with _phase(probe, "load"):
        tensors = CheckpointTensors(shared[0])
        step = tensors.manifest.step
        load_engine_state(engine, tensors, step)
        del tensors
    emit("resumed", step=step, checkpoint=shared[0])
    return step


def _truncate_metrics(path: Path, last_step: int) -> None:
    """Drop lines past the resumed step, so metrics.jsonl reads as one uninterrupted run."""
    if not path.exists():
        return
    keep = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= last_step]
    path.write_text("".join(line + "\n" for line in keep))


def _report_memory(probe: RankMemoryProbe, job: JobConfig, run_dir: Path) -> None:
    """Gather every rank's measured peak next to the planner's prediction; rank 0 writes
    ``memory.json`` and emits a ``memory`` event."""
    rank = dist.get_rank()
    predicted = job_rank_memory(ModelShape.from_config(job.model_path), job, rank)
    mine = {
        "rank": rank,
        "measured_bytes": int(probe.measured["peak"]),
        "phase": probe.measured["phase"],
        "predicted_bytes": int(predicted.total),
        "predicted": {k: int(v) if isinstance(v, float | int) else v for k, v in predicted.as_dict().items()},
    }
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        (run_dir / "memory.json").write_text(json.dumps(everyone, indent=1))
        brief = [{k: r[k] for k in ("rank", "measured_bytes", "predicted_bytes", "phase")} for r in everyone]
        emit("memory", ranks=brief)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        raise SystemExit("usage: python -m neuron_parallel.train RUN_DIR/job.json")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    run_training(JobConfig.load(argv[0]), after_checkpoint=_hooks_from_env())
    exit_rank(0)


if __name__ == "__main__":
    main()
