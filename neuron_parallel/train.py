"""The training entry point torchrun starts in every rank.

    torchrun --nproc_per_node N -m neuron_parallel.train RUN_DIR/job.json

Resumes from the newest complete checkpoint in the run directory (or ``resume_from``), trains
to ``train.max_steps``, writes ``metrics.jsonl`` (rank 0, one object per optimizer step) and
checkpoints every ``train.save_every`` steps. Progress goes to stdout as one JSON object per
line prefixed with ``EVENT_PREFIX``, which the launcher turns into progress events.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from .checkpoint import CheckpointTensors, CheckpointWriter
from .checkpoint.resume import find_resume_checkpoint
from .config import JobConfig
from .data import BlockStream
from .engine import build_engine
from .memprof import PHASE_PREFIX, TensorMemoryProfile
from .mesh import ParallelDims, init_distributed, local_device
from .optim import lr_at
from .planning.layout import check_layout
from .planning.memory import ModelShape, job_rank_memory

EVENT_PREFIX = "@@neuron-flows "
FAIL_AFTER_ENV = "NEURON_FLOWS_FAIL_AFTER_STEP"
"""Failure injection: every rank exits with an error right after the checkpoint of this step."""


def emit(event: str, **fields) -> None:
    """A structured progress line on stdout (rank 0 only)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(EVENT_PREFIX + json.dumps({"event": event, **fields}), flush=True)


def _truncate_metrics(path: Path, last_step: int) -> None:
    """Drop lines past the resumed step, so metrics.jsonl reads as one uninterrupted run."""
    if not path.exists():
        return
    keep = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= last_step]
    path.write_text("".join(line + "\n" for line in keep))


def run_training(job: JobConfig) -> None:
    check_layout(job)  # a layout the model cannot take fails here, before any rank loads weights
    init_distributed(job.device)
    device = local_device(job.device)
    pc = job.parallel
    dims = ParallelDims(dp=pc.dp, pp=pc.pp, tp=pc.tp, device_type=job.device)
    rank = dist.get_rank()
    run_dir = Path(job.output_dir)
    probe = _MemoryProbe(job.device) if job.train.profile_memory else None
    with probe or contextlib.nullcontext():
        _run(job, dims, device, rank, run_dir, probe)
    if probe:
        probe.report(job, rank, run_dir)
    dist.barrier()
    emit("done", step=job.train.max_steps, run_dir=str(run_dir))
    dist.destroy_process_group()


def _phase(probe, name: str):
    return probe.phase(name) if probe else contextlib.nullcontext()


def _run(job: JobConfig, dims: ParallelDims, device, rank: int, run_dir: Path, probe) -> None:
    tc = job.train
    metrics_path = run_dir / "metrics.jsonl"
    torch.manual_seed(tc.seed)
    stream = BlockStream(job.dataset_path, seed=tc.seed)
    engine = build_engine(job, dims, device)

    start_step = 0
    ckpt, skipped = find_resume_checkpoint(run_dir, job.train.resume_from) if rank == 0 else (None, [])
    shared = [str(ckpt) if ckpt else None, skipped]
    dist.broadcast_object_list(shared, src=0)
    for why in shared[1]:
        emit("warning", message=why)
    if shared[0]:
        with _phase(probe, "load"):
            tensors = CheckpointTensors(shared[0])
            start_step = tensors.manifest.step
            engine.load_checkpoint(tensors, start_step)
            del tensors
        emit("resumed", step=start_step, checkpoint=shared[0])
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        _truncate_metrics(metrics_path, start_step)
    emit("start", step=start_step, max_steps=tc.max_steps, world_size=dims.world_size, **_layout(job))

    writer = CheckpointWriter(
        run_dir, coords=dims.coordinates(), model_dir=job.model_path, keep=tc.keep_checkpoints, async_save=tc.async_save
    )
    _train_steps(job, engine, stream, dims, device, writer, start_step, rank, metrics_path, probe)


def _train_steps(job, engine, stream, dims, device, writer, start_step, rank, metrics_path, probe) -> None:
    tc, pc = job.train, job.parallel
    G = job.global_batch_size
    mbs, dp_rank = tc.micro_batch_size, dims.coordinates()["dp_rank"]
    tokens_per_step = G * job.block_size
    fail_after = int(os.environ.get(FAIL_AFTER_ENV, "0") or 0)
    t_start = time.perf_counter()
    for step in range(start_step + 1, tc.max_steps + 1):
        t0 = time.perf_counter()
        torch.manual_seed(tc.seed * 100_003 + step)
        base = (step - 1) * G
        loss_sum = torch.zeros((), device=device)
        for a in range(job.grad_accum):
            inputs, labels = stream.batch(base + a * mbs * pc.dp + dp_rank * mbs, mbs)
            loss_sum += engine.forward_backward(inputs, labels, 1.0 / job.grad_accum)
        grad_norm = engine.reduce_and_clip()
        lr = lr_at(step, tc)
        engine.optimizer_step(lr)
        loss = loss_sum / job.grad_accum
        dist.all_reduce(loss, group=dims.mesh["dp"].get_group())
        loss = loss.item() / pc.dp
        dt = time.perf_counter() - t0
        record = {
            "step": step,
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm.item(),
            "tokens_per_s": tokens_per_step / dt,
            "tokens_seen": step * tokens_per_step,
            "step_time_s": dt,
            "elapsed_s": time.perf_counter() - t_start,
        }
        if rank == 0:
            with metrics_path.open("a") as f:
                f.write(json.dumps(record) + "\n")
        if step % tc.log_every == 0 or step == tc.max_steps:
            emit("step", max_steps=tc.max_steps, **record)
        if (tc.save_every and step % tc.save_every == 0) or step == tc.max_steps:
            t_save = time.perf_counter()
            with _phase(probe, "save"):
                path = _save(writer, engine, step, dp_rank, pc, tc, tokens_per_step, G, lr, record)
            emit(
                "checkpoint",
                step=step,
                path=str(path),
                blocked_s=time.perf_counter() - t_save,
                async_save=tc.async_save,
            )
            if fail_after and step == fail_after:  # a run resumed past it does not fail again
                writer.wait()
                dist.barrier()
                emit("failure_injected", step=step)
                os._exit(3)
    with _phase(probe, "save"):
        writer.wait()


def _save(writer, engine, step, dp_rank, pc, tc, tokens_per_step, G, lr, record) -> Path:
    return writer.save(
        step,
        model=engine.model_tensors(),
        optim=engine.optim_tensors(dp_rank),
        parallel=pc,
        trainer_state={
            "step": step,
            "tokens_seen": step * tokens_per_step,
            "samples_seen": step * G,
            "global_batch_size": G,
            "lr": lr,
            "lr_schedule": {
                k: getattr(tc, k) for k in ("lr", "warmup_steps", "lr_schedule", "min_lr_ratio", "max_steps")
            },
            "seed": tc.seed,
            "rng": "per-step torch seed = seed * 100003 + step; data order from (seed, epoch)",
            "metrics": record,
        },
    )


class _MemoryProbe:
    """Peak tensor memory of this rank from before the model is built to the last step;
    checkpoint loads and saves excluded (``train.profile_memory``)."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.cpu = TensorMemoryProfile() if device == "cpu" else None
        self.measured: dict = {}

    def __enter__(self):
        if self.cpu:
            self.cpu.__enter__()
        else:
            torch.accelerator.reset_peak_memory_stats()
        return self

    def __exit__(self, *exc) -> None:
        if self.cpu:
            self.cpu.__exit__(*exc)
            self.measured = self.cpu.peak(exclude=("save", "load"))
        else:
            self.measured = {"peak": torch.accelerator.max_memory_allocated(), "phase": "all (device allocator)"}

    def phase(self, name: str):
        if self.cpu:
            return torch.profiler.record_function(PHASE_PREFIX + name)
        return contextlib.nullcontext()

    def report(self, job: JobConfig, rank: int, run_dir: Path) -> None:
        """Gather every rank's measurement next to the planner's prediction; rank 0 writes
        ``memory.json`` and emits a ``memory`` event."""
        predicted = job_rank_memory(ModelShape.from_config(job.model_path), job, rank)
        mine = {
            "rank": rank,
            "measured_bytes": int(self.measured["peak"]),
            "phase": self.measured["phase"],
            "predicted_bytes": int(predicted.total),
            "predicted": {k: int(v) if isinstance(v, float | int) else v for k, v in predicted.as_dict().items()},
        }
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        if rank == 0:
            (run_dir / "memory.json").write_text(json.dumps(everyone, indent=1))
            emit(
                "memory",
                ranks=[{k: r[k] for k in ("rank", "measured_bytes", "predicted_bytes", "phase")} for r in everyone],
            )


def _layout(job: JobConfig) -> dict:
    pc = job.parallel
    return {"dp": pc.dp, "tp": pc.tp, "pp": pc.pp, "zero_1": pc.zero_1, "global_batch_size": job.global_batch_size}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        raise SystemExit("usage: python -m neuron_parallel.train RUN_DIR/job.json")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    run_training(JobConfig.load(argv[0]))


if __name__ == "__main__":
    main()
