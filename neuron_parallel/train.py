"""The training entry point torchrun starts in every rank.

    torchrun --nproc_per_node N -m neuron_parallel.train RUN_DIR/job.json

Resumes from the newest complete checkpoint in the run directory (or ``train.resume_from``),
trains to ``train.max_steps``, writes ``metrics.jsonl`` (rank 0, one object per optimizer step)
and checkpoints every ``train.save_every`` steps. A plain step (one that does not log, evaluate
or checkpoint) reads nothing back from the device: its row is finished and written at the next
step that does (``neuron_parallel.step_log``). Progress goes to stdout as one JSON object per
line prefixed with ``EVENT_PREFIX``, which the launcher turns into progress events.

One optimizer step always consumes ``train.global_batch_size`` sequences (:data:`BATCH_RULE`);
the start event and every checkpoint's ``trainer_state.json`` state the numbers behind it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from .batches import BlockStream, EvalRows
from .checkpoint import CheckpointTensors, CheckpointWriter
from .checkpoint.engine_state import (
    adapter_meta,
    load_engine_state,
    model_tensors,
    optim_tensors,
)
from .checkpoint.format import TRAINER_STATE, base_model_identity, check_base_model
from .checkpoint.output import OutputDirRefused, check_run_dir, claim_run_dir
from .checkpoint.resume import find_resume_checkpoint
from .checkpoint.save import CheckpointSaveFailed
from .config import JobConfig
from .engine import Engine, build_engine
from .launch import AWAIT_JOB, EVENT_PREFIX
from .lineage import SourcesChanged, check_same_sources
from .memprof import RankMemoryProbe
from .mesh import ParallelDims, close_distributed, exit_rank, init_distributed, local_device
from .optim import lr_at
from .planning.layout import check_layout
from .planning.memory import ModelShape, job_rank_memory
from .preference import PAIR_LOSS_RULE, STATS, check_reference, stats_row
from .reporting import EtaClock, MetricsReporter, metrics_reporter, peak_memory_bytes, read_metrics
from .run_files import JOB_FILE, MEMORY_FILE, METRICS_FILE
from .step_log import PendingStep, StepRows
from .utils import read_json, write_line

FAIL_AFTER_ENV = "NEURON_FLOWS_FAIL_AFTER_STEP"
"""Failure injection for tests: every rank exits with status 3 right after the checkpoint of this
step is complete (see :func:`fail_after_checkpoint`)."""
BATCH_RULE = (
    "global_batch_size = micro_batch_size × dp × grad_accum, fixed by train.global_batch_size whatever the layout"
)
LOSS_RULE = (
    "loss = sum of token losses over the labelled tokens of the whole global batch / their number, "
    "whatever the layout, accumulation or pipeline microbatching"
)
"""How a step's loss is normalised. Every micro-batch's backward sees its summed token loss /
N, where N counts the labelled tokens of the global batch (every rank counts them on the host
from the rows' labels, ``BlockStream.num_targets``); the all-reduce of gradients over the dp × cp
ranks sums them, so the update is the gradient of the global mean, exactly as one process
computes it (under context parallelism a rank's summed loss is that of its positions
of the rows, and the cp ranks' gradients add up to the rows'). A mean per micro-batch would not
be: SFT rows hold different numbers of trained tokens."""
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


def _every(step: int, interval: int) -> bool:
    """Whether ``step`` is a multiple of ``interval`` (never, for 0)."""
    return bool(interval) and step % interval == 0


def _phase(probe: RankMemoryProbe | None, name: str):
    return probe.phase(name) if probe else contextlib.nullcontext()


@dataclass
class EvalState:
    """The eval history early stopping needs, carried in every checkpoint's trainer state."""

    best_loss: float | None = None
    evals_without_improvement: int = 0
    stopped_early: bool = False

    def update(self, eval_loss: float) -> None:
        if self.best_loss is None or eval_loss < self.best_loss:
            self.best_loss, self.evals_without_improvement = eval_loss, 0
        else:
            self.evals_without_improvement += 1


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
    eval_rows: EvalRows | None = None
    eval_state: EvalState = field(default_factory=EvalState)
    base_model: dict | None = None
    """Under LoRA, the frozen base's identity (``base_model_identity``), stored with every checkpoint."""
    reporter: MetricsReporter = field(default_factory=lambda: MetricsReporter("", [], start_step=0))
    """Where rank 0 sends each step's record besides metrics.jsonl (``train.report_to``)."""

    @property
    def dp_rank(self) -> int:
        return self.dims.coordinates()["dp_rank"]

    @property
    def tokens_per_step(self) -> int:
        return self.job.global_batch_size * self.job.block_size

    def run(self, start_step: int) -> int:
        """Optimizer steps ``start_step + 1 .. train.max_steps`` (fewer if early stopping ends
        them), then wait for the last save. Returns the last step trained.

        A step that logs (every ``train.log_every``), evaluates or checkpoints closes the window
        of steps since the last one (:class:`~neuron_parallel.step_log.StepRows`): one device
        synchronize and one read give their rows, which rank 0 writes to ``metrics.jsonl`` and
        the reporters before any evaluation result is announced or checkpoint saved (so every
        row up to a checkpoint's step is on disk when it completes); then a failed background
        save stops every rank (``writer.check``). The other steps read nothing back from the
        device."""
        tc = self.job.train
        eta = EtaClock(start_step, tc.max_steps)
        rows = StepRows(self.engine.device, self.tokens_per_step)
        step = start_step
        while step < tc.max_steps and not self.eval_state.stopped_early:
            step += 1
            rows.add(self.train_step(step))
            if step == start_step + 1 and self.job.launch.start_timeout_s != self.job.launch.timeout_s:
                self.dims.set_timeout(self.job.launch.timeout_s)  # this start's graphs are compiled
            evaluates = self.eval_rows is not None and (step == tc.max_steps or _every(step, tc.eval_every))
            saves = step == tc.max_steps or _every(step, tc.save_every)
            if not (evaluates or saves or _every(step, tc.log_every)):
                continue
            finished = rows.close()
            record = finished[-1]
            if dist.get_rank() == 0 and (peak := peak_memory_bytes(self.engine.device)) is not None:
                record["peak_memory_bytes"] = peak  # the device's peak so far, read at this step only
            if evaluates:
                record.update(self.evaluate(step))
            self._write_rows(finished)
            self.writer.check()  # a failed background save stops every rank here
            last = step == tc.max_steps or self.eval_state.stopped_early
            if _every(step, tc.log_every) or last:
                emit("step", max_steps=tc.max_steps, eta_s=round(0.0 if last else eta.eta_s(step), 1), **record)
            if saves or last:
                self.checkpoint(step, record)
            rows.restart()
        with _phase(self.probe, "save"):
            self.writer.wait()
        return step

    def _write_rows(self, rows: list[dict]) -> None:
        """Rank 0: append ``rows`` to metrics.jsonl and send them to the reporters."""
        if dist.get_rank() != 0:
            return
        with self.metrics_path.open("a") as f:
            f.write("".join(json.dumps(row) + "\n" for row in rows))
        for row in rows:
            self.reporter.log(row)

    def train_step(self, step: int) -> PendingStep:
        """One optimizer step over ``global_batch_size`` sequences: this dp rank's share, in
        ``grad_accum`` micro-batches, normalised by :data:`LOSS_RULE`. Reads nothing back from
        the device: returns the step with its loss and gradient norm still there."""
        job, tc, dp = self.job, self.job.train, self.dims.dp
        torch.manual_seed(tc.seed * 100_003 + step)
        mbs, base = tc.micro_batch_size, (step - 1) * job.global_batch_size
        batches = [self.stream.batch(base + a * mbs * dp + self.dp_rank * mbs, mbs) for a in range(job.grad_accum)]
        num_targets = self.stream.num_targets(base, job.global_batch_size)
        pairs = self.stream.num_pairs(base, job.global_batch_size) if self.engine.preference else None
        # PAIR_LOSS_RULE under a preference objective: the same rule with pairs in place of tokens.
        scale = 1 / max(num_targets if pairs is None else pairs, 1)
        loss_sum = torch.zeros(() if pairs is None else (len(STATS),), device=self.engine.device)
        for a, batch in enumerate(batches):
            # The last micro-batch's backward starts the dp reduction, bucket by bucket.
            loss_sum += self.engine.forward_backward(batch, scale, last=a == len(batches) - 1)
        grad_norm = self.engine.reduce_and_clip()
        # The loss total travels during the optimizer step. Started only now, after every gradient
        # bucket, so that each dp rank issues its collectives in the same order. Each dp × cp rank
        # holds its share (Engine.forward_backward).
        loss_total = dist.all_reduce(loss_sum, group=self.dims.group("dp_cp"), async_op=True)
        lr = lr_at(step, tc)
        self.engine.optimizer_step(lr)
        loss_total.wait()
        if pairs is not None:
            return PendingStep(
                step, lr, step * self.tokens_per_step, num_targets, loss_sum[0], grad_norm, pairs, loss_sum
            )
        return PendingStep(step, lr, step * self.tokens_per_step, num_targets, loss_sum, grad_norm)

    def evaluate(self, step: int) -> dict:
        """The eval loss after ``step``: the summed token loss over every labelled token of the
        eval rows / their number, whatever the layout. Each round reads ``micro_batch_size`` rows
        per dp rank (the training shape, which pipeline buffers are sized for); the last round
        is filled up with empty rows. Updates early stopping and emits an ``eval`` event.

        Each round's summed loss stays on the device in fp32; the rounds of every dp rank are
        gathered once and added up on the host in double precision (no float64 on the device);
        the labelled tokens are counted on the host from the rows."""
        t0 = time.perf_counter()
        mbs, dp, device = self.job.train.micro_batch_size, self.dims.dp, self.engine.device
        rounds = [
            self.engine.eval_loss(self.eval_rows.batch(start + self.dp_rank * mbs, mbs)).float()
            for start in range(0, self.eval_rows.num_rows, mbs * dp)
        ]
        width = (len(STATS),) if self.engine.preference else ()
        mine = torch.stack(rounds) if rounds else torch.zeros((0, *width), device=device)
        # Each dp × cp rank's share of its rounds (Engine.eval_loss): the cp ranks of a dp rank
        # evaluate the same rows, each its positions of them.
        everyone = [torch.empty_like(mine) for _ in range(self.dims.dp_cp)]
        dist.all_gather(everyone, mine, group=self.dims.group("dp_cp"))
        count = self.eval_rows.num_targets
        if self.engine.preference:  # each round's STATS: the mean per-pair values over every eval pair
            pairs = self.eval_rows.num_pairs
            per_round = torch.stack(everyone).flatten(0, 1).tolist()  # summed on the host: no float64 on the device
            totals = [sum(column) for column in zip(*per_round)] if per_round else [0.0] * len(STATS)
            fields = {**stats_row(totals, pairs, prefix="eval_"), "eval_tokens": count, "eval_pairs": pairs}
            eval_loss = fields["eval_loss"]
        else:
            total = sum(sum(sums) for sums in torch.stack(everyone).tolist())
            eval_loss = total / max(count, 1)
            fields = {"eval_loss": eval_loss, "eval_tokens": count}
        patience = self.job.train.early_stopping_patience
        self.eval_state.update(eval_loss)
        emit("eval", step=step, eval_time_s=time.perf_counter() - t0, **fields)
        if patience and self.eval_state.evals_without_improvement >= patience:
            self.eval_state.stopped_early = True
            reason = f"{patience} evals without a lower eval loss than {self.eval_state.best_loss:.6g}"
            emit("early_stop", step=step, reason=reason)
        return fields

    def checkpoint(self, step: int, record: dict) -> None:
        """Save the checkpoint of ``step``, emit a ``checkpoint`` event, run the hooks."""
        t_save = time.perf_counter()
        with _phase(self.probe, "save"):
            path = self.writer.save(
                step,
                model=model_tensors(self.engine),
                optim=optim_tensors(self.engine, self.dims.dp_cp_rank),
                parallel=self.job.parallel,
                trainer_state=self.trainer_state(step, record),
                adapter=adapter_meta(self.engine, self.base_model),
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
            "mixed_precision": self.job.parallel.mixed_precision,  # what ran: auto resolved for the device
            "lr": record["lr"],
            "lr_schedule": {k: getattr(tc, k) for k in _LR_FIELDS},
            "seed": tc.seed,
            "rng": "per-step torch seed = seed * 100003 + step; data order from (seed, epoch)",
            "loss_rule": LOSS_RULE if tc.objective == "sft" else PAIR_LOSS_RULE,
            "eval": dataclasses.asdict(self.eval_state),
            "metrics": record,
            "lineage": self.job.lineage,  # the model, data and versions trained on (neuron_parallel.lineage)
        }


def run_training(job: JobConfig, after_checkpoint: list[CheckpointHook] | None = None) -> None:
    """Train ``job`` on this rank (inside torchrun), in a process group joined for it and left
    after it; ``after_checkpoint`` hooks run after every checkpoint (see :data:`CheckpointHook`)."""
    init_distributed(job.device, timeout_s=job.launch.start_timeout_s)
    train_job(job, after_checkpoint)
    close_distributed()


def train_job(job: JobConfig, after_checkpoint: list[CheckpointHook] | None = None) -> None:
    """Train ``job`` on this rank in the process group it is in (whose world is the job's);
    ``run_training`` joins and leaves one around it. An ``output_dir`` holding files neuron-flows
    did not write is refused on every rank before anything is read or written."""
    check_run_dir(job.output_dir)
    check_layout(job)  # a layout the model cannot take fails here, before any rank loads weights
    pc = job.parallel
    timeout_s = job.launch.start_timeout_s  # launch.timeout_s once the first step is done (Trainer.run)
    dims = ParallelDims(dp=pc.dp, cp=pc.cp, pp=pc.pp, tp=pc.tp, device_type=job.device, timeout_s=timeout_s)
    run_dir = Path(job.output_dir)
    probe = RankMemoryProbe(job.device, exclude=("save", "load")) if job.train.profile_memory else None
    with probe or contextlib.nullcontext():
        trainer, start_step = _prepare(job, dims, run_dir, probe, list(after_checkpoint or ()))
        with trainer.reporter:
            last_step = trainer.run(start_step)
    if probe:
        _report_memory(probe, job, run_dir)
    dist.barrier()
    emit("done", step=last_step, run_dir=str(run_dir), stopped_early=trainer.eval_state.stopped_early)


def _prepare(job: JobConfig, dims: ParallelDims, run_dir: Path, probe, hooks) -> tuple[Trainer, int]:
    """Build the engine, restore the newest checkpoint if any, and announce the start."""
    tc = job.train
    metrics_path = run_dir / METRICS_FILE
    torch.manual_seed(tc.seed)
    if tc.objective == "dpo" and tc.lora is None and job.reference_path is None:
        raise ValueError(
            "train.objective=dpo without train.lora needs the reference log-probabilities (job reference_path); "
            "run the reference step before training, or set train.lora"
        )
    _check_reference(job)
    ref = Path(job.reference_path) if job.reference_path else None
    stream = BlockStream(job.dataset_path, seed=tc.seed, reference=ref / "train" if ref else None)
    engine = build_engine(job, dims, local_device(job.device))
    base = _base_identity(job)
    start_step, eval_state = _resume(job, engine, run_dir, probe, base)
    if dist.get_rank() == 0:
        claim_run_dir(run_dir)
        _truncate_metrics(metrics_path, start_step)
    pc = job.parallel
    layout = {"tp": pc.tp, "pp": pc.pp, "cp": pc.cp, "zero_1": pc.zero_1, **batch_layout(job)}
    emit("start", step=start_step, max_steps=tc.max_steps, world_size=dims.world_size, **layout)
    # The ranks that hold the same parameters (dp × cp) write them once, from dp_cp rank 0, and
    # each its own ZeRO-1 partition of the optimizer state: the checkpoint's dp rank is the dp_cp rank.
    writer = CheckpointWriter(
        run_dir,
        coords={**dims.coordinates(), "dp_rank": dims.dp_cp_rank},
        model_dir=job.model_path,
        keep=tc.keep_checkpoints,
        async_save=tc.async_save,
        timeout_s=job.launch.timeout_s,
        device=engine.device,
    )
    for name in writer.remove_partial():
        emit("warning", message=f"removed {run_dir / name}, the partial folder of a checkpoint save cut short")
    eval_reference = ref / "eval" if ref and job.eval_dataset_path else None
    eval_rows = EvalRows(job.eval_dataset_path, eval_reference) if job.eval_dataset_path else None
    trainer = Trainer(job, engine, stream, dims, writer, metrics_path, probe, hooks, eval_rows, eval_state, base)
    trainer.reporter = metrics_reporter(job, rank=dist.get_rank(), start_step=start_step)
    return trainer, start_step


def _check_reference(job: JobConfig) -> None:
    """Refuse on every rank, before any weight is loaded, a reference folder computed for another
    model or other rows than the job's (``preference.check_reference``): checked on rank 0, which
    hashes the weights once, and its verdict shared."""
    if job.reference_path is None:
        return
    why = [None]
    if dist.get_rank() == 0:
        try:
            check_reference(job.reference_path, job.model_path, job.dataset_path, job.eval_dataset_path)
        except ValueError as e:
            why[0] = str(e)
    dist.broadcast_object_list(why, src=0)
    if why[0]:
        raise ValueError(why[0])


def _base_identity(job: JobConfig) -> dict | None:
    """Under LoRA, the base model's identity, hashed once on rank 0 and shared."""
    if job.train.lora is None:
        return None
    shared = [base_model_identity(job.model_path) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(shared, src=0)
    return shared[0]


def _resume(job: JobConfig, engine: Engine, run_dir: Path, probe, base: dict | None) -> tuple[int, EvalState]:
    """Load the checkpoint rank 0 picks (warning about any it skipped); the step it was at (or 0)
    and the eval history it carries (a run that stopped early stays stopped)."""
    found = find_resume_checkpoint(run_dir, job.train.resume_from) if dist.get_rank() == 0 else (None, [])
    shared = [str(found[0]) if found[0] else None, found[1]]
    dist.broadcast_object_list(shared, src=0)
    for why in shared[1]:
        emit("warning", message=why)
    if not shared[0]:
        return 0, EvalState()
    with _phase(probe, "load"):
        tensors = CheckpointTensors(shared[0])
        step = tensors.manifest.step
        if base is not None:
            check_base_model(tensors.manifest, base)
        state_file = Path(shared[0]) / TRAINER_STATE
        state = read_json(state_file) if state_file.is_file() else {}
        if Path(shared[0]).parent.resolve() == run_dir.resolve():  # a retry: the same model and data only
            check_same_sources(state.get("lineage"), job.lineage, shared[0])
        load_engine_state(engine, tensors, step)
        del tensors
    saved = state.get("eval", {})
    emit("resumed", step=step, checkpoint=shared[0])
    return step, EvalState(**saved)


def _truncate_metrics(path: Path, last_step: int) -> None:
    """Drop lines past the resumed step (and any torn line), so metrics.jsonl reads as one
    uninterrupted run; rewritten through a temporary file renamed into place."""
    if not path.exists():
        return
    keep = [r for r in read_metrics(path) if r["step"] <= last_step]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in keep))
    os.replace(tmp, path)


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
        (run_dir / MEMORY_FILE).write_text(json.dumps(everyone, indent=1))
        brief = [{k: r[k] for k in ("rank", "measured_bytes", "predicted_bytes", "phase")} for r in everyone]
        emit("memory", ranks=brief)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 2 and argv[0] == AWAIT_JOB:
        argv = argv[1:]
        _await_job(Path(argv[0]))
    if len(argv) != 1:
        raise SystemExit(f"usage: python -m neuron_parallel.train [{AWAIT_JOB}] RUN_DIR/{JOB_FILE}")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    job = JobConfig.load(argv[0])
    try:
        run_training(job, after_checkpoint=_hooks_from_env())
    except Exception as e:
        why = _why_stopped(e, job)
        if why is None:
            raise
        if why:
            sys.stderr.flush()
            os.write(sys.stderr.fileno(), (why + "\n").encode())  # one write: the launcher shows the last lines
        exit_rank(1)
    exit_rank(0)


def _await_job(path: Path, poll_s: float = 0.02) -> None:
    """Wait, everything imported, until the launcher writes the job file (``ReadyRanks``); end
    quietly if torchrun, this rank's parent, is gone first."""
    parent = os.getppid()
    # What every job loads once it comes, imported while it has not: the reader of the tokenized
    # data and transformers' model base (a model's own module is small).
    import datasets  # noqa: F401
    import transformers.modeling_utils  # noqa: F401

    while not path.exists():
        if os.getppid() != parent:
            exit_rank(0)
        time.sleep(poll_s)


def _why_stopped(error: Exception, job: JobConfig) -> str | None:
    """What a rank that ``error`` stops says: a failed checkpoint save, a refused run directory or a
    checkpoint of another model or other data to resume (every rank has it; rank 0 tells, the others
    say nothing) or a collective that waited past ``launch.timeout_s``. None for any other error,
    which propagates with its traceback."""
    rank = os.environ.get("RANK", "0")
    if isinstance(error, CheckpointSaveFailed | OutputDirRefused | SourcesChanged):
        return f"error: {error}" if rank == "0" else ""
    text = str(error).strip()
    if not isinstance(error, RuntimeError) or not ("timed out" in text.lower() or "timeout" in text.lower()):
        return None
    return (
        f"error: rank {rank} waited more than launch.timeout_s={job.launch.timeout_s:g} s for another rank in a "
        f"collective ({text.splitlines()[0] if text else type(error).__name__}): a rank hung, stopped or died. "
        "Training stopped; run again to resume from the last complete checkpoint (raise launch.timeout_s if a "
        "step, evaluation or checkpoint write legitimately takes longer)."
    )


if __name__ == "__main__":
    main()
