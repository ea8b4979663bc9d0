"""``neuron-flows doctor``: whether this host can run a job, before it starts a long one.

Four parts, each a list of :class:`Check` (name, ok, detail, seconds):

- the stack (:func:`stack_checks`, in this process, the device untouched): torch and its device
  runtime (CUDA, or torch-neuronx of the same torch release), devices for every rank of the node,
  on neuron the logical core setting and ``NEURON_RT_VISIBLE_CORES`` as the runtime wants them,
  free disk for two checkpoints of the run's model, the compile cache directory (writable; on
  neuron, on a volume every node mounts when there are several), with several nodes EFA, the
  rendezvous endpoint and a shared work directory;
- one rank (:class:`RankJob` ``one``): ``python -m neuron_parallel.doctor_ranks one`` on the
  device: a tensor, a bf16 autocast matmul, attention at the run's shapes and the kernel that
  ran, the allocator's statistics;
- every rank (:class:`RankJob` ``all``): the same module under torchrun with the run's layout:
  collectives on the dp, tp and pp groups, ``batch_isend_irecv``, a barrier, object collectives;
- a parity smoke (:func:`parity_check`): :data:`PARITY_STEPS` steps of the training entry point
  (``train.train_job``) on the device across those ranks, against one CPU process
  (``launch.run_torchrun``), losses and gradient norms within :data:`PARITY_RTOL`.

:func:`run_doctor` runs them all (``quick``: the stack and one rank, what the pipeline's preflight
step runs on accelerator workers). A device the host lacks raises ``ValueError`` before any check
runs.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from .config import DataConfig, JobConfig, LaunchConfig, ParallelConfig, TrainConfig
from .doctor_ranks import DOCTOR_PREFIX, RankSpec
from .doctor_stack import Check, DoctorTarget, check_present, first_line, stack_checks

PARITY_STEPS = 3
PARITY_RTOL = {"cpu": (1e-5, 1e-4), "cuda": (1e-2, 1e-2), "neuron": (1e-2, 1e-2)}
"""(loss, gradient norm) bound of the parity smoke, relative, by device. CPU against CPU differs
only in the order of reductions (≈1e-6 measured over every layout). On accelerators fp32 matmuls
may run as TF32 (the trainer enables it on CUDA) or in the device's own fp32 path; a missed or
doubled reduction, a wrong shard or a wrong kernel is off by far more than 1e-2 in the gradient
norm."""
PARITY_MAX_PARAMETERS = 200e6
"""The run's own model is the parity smoke's up to this size (one CPU process trains it too);
beyond it, a tiny Llama shaped for the layout stands in."""
COLLECTIVE_TIMEOUT_S = 600.0
"""The longest a rank job's collective waits for a peer (less when ``launch.timeout_s`` is)."""


def run_doctor(target: DoctorTarget, *, quick: bool = False) -> list[Check]:
    """Every check for ``target`` (``quick``: the stack and one rank). Raises ``ValueError`` when
    the host lacks the device, before any check runs. The one-rank process runs while this one
    checks the stack and builds the parity smoke's model and data (then starts its CPU process);
    it ends before any other rank starts (a rank owns its device)."""
    check_present(target.device)
    one = RankJob(target, "one")
    checks = stack_checks(target)
    if quick:
        return checks + one.checks(target.launch.start_timeout_s)
    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=1) as pool:  # in order: the parity inputs, then the CPU run
        jobs = pool.submit(_timed, lambda: parity_jobs(target))
        reference = pool.submit(_timed, lambda: _reference_after(jobs))
        checks += one.checks(target.launch.start_timeout_s)
        prepared, _ = jobs.result()
        ranks = RankJob(target, "all", None if isinstance(prepared, Exception) else prepared[0])
        checks += ranks.checks(target.launch.start_timeout_s + 600)
        ref, _ = reference.result()
    seconds = time.monotonic() - t0
    if isinstance(prepared, Exception):
        return checks + [Check(PARITY, False, f"could not prepare the model and data: {first_line(prepared)}", seconds)]
    device_run = next((c for c in checks if c.name == PARITY_RUN), None)
    return checks + [parity_check(*prepared, device_run, ref, seconds)]


def _reference_after(jobs: Future):
    """The parity smoke's CPU run once ``jobs`` has prepared it (what preparing raised, if it did)."""
    prepared, _ = jobs.result()
    return prepared if isinstance(prepared, Exception) else run_reference(prepared[1])


def _timed(fn: Callable):
    """(``fn()`` or the exception it raised, seconds)."""
    t0 = time.monotonic()
    try:
        return fn(), time.monotonic() - t0
    except Exception as e:  # reported as the failed check's detail
        return e, time.monotonic() - t0


# The rank jobs -----------------------------------------------------------------------------------


def rank_spec(target: DoctorTarget) -> RankSpec:
    """What the rank jobs run: the layout, and attention as one rank of the run computes it (its
    query heads, one pipeline microbatch of its micro batch)."""
    from .planning.attention import attention_path

    shape = target.shape() or DoctorTarget.for_launch(target.launch, target.hardware).shape()
    pc = target.parallel
    return RankSpec(
        device=target.device,
        dp=pc.dp,
        tp=pc.tp,
        pp=pc.pp,
        timeout_s=min(COLLECTIVE_TIMEOUT_S, target.launch.start_timeout_s),
        batch=max(1, target.micro_batch_size // pc.num_microbatches),
        heads=max(1, shape.num_heads // pc.tp),
        seq_len=target.seq_len,
        head_dim=shape.head_dim,
        planned_attention=attention_path(target.device, False, target.seq_len, shape.head_dim),
    )


class RankJob:
    """A rank job of ``doctor_ranks`` started now (``one``: a process of its own; ``all``: torchrun
    with the target's launch, then ``job``, the parity smoke's device run, in the same process
    group); :meth:`checks` waits for its reports."""

    def __init__(self, target: DoctorTarget, kind: str, job: JobConfig | None = None) -> None:
        from .launch import start_torchrun, torchrun_prefix
        from .procs import die_with_parent

        self.kind, self.t0 = kind, time.monotonic()
        self.ranks = 1 if kind == "one" else target.launch.nproc_per_node
        self.tmp = tempfile.TemporaryDirectory(prefix="neuron-doctor-")
        spec = Path(self.tmp.name) / "spec.json"
        spec.write_text(rank_spec(target).to_json())
        program = ["-m", "neuron_parallel.doctor_ranks", kind, str(spec)]
        if job is not None:
            (Path(self.tmp.name) / "job.json").write_text(job.to_json())
            program.append(str(Path(self.tmp.name) / "job.json"))
        if kind == "all":
            self.proc = start_torchrun(torchrun_prefix(target.launch) + program, target.launch, None)
            return
        # A world of one, whatever this process inherited.
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
        self.proc = subprocess.Popen(
            [sys.executable, *program],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**env, "PYTHONUNBUFFERED": "1"},
            start_new_session=True,
            preexec_fn=die_with_parent(os.getpid()),
        )

    def checks(self, timeout_s: float) -> list[Check]:
        """Every check the ranks reported, once they end (or are ended after ``timeout_s``): one
        passes when every rank of this node passed it. A job that died or hung adds a failed check
        with its last lines."""
        from .launch import read_tagged
        from .procs import kill_tree

        try:
            out, _ = self.proc.communicate(timeout=timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            kill_tree(self.proc)
            out, timed_out = self.proc.communicate()[0], True
        finally:
            kill_tree(self.proc)
            self.tmp.cleanup()
        by_name: dict[str, list[dict]] = {}
        for line in out.splitlines():
            if (r := read_tagged(line, DOCTOR_PREFIX)) is not None and "name" in r:
                by_name.setdefault(r["name"], []).append(r)
        checks = [self._merged(name, rows, out) for name, rows in by_name.items()]
        if timed_out or (self.proc.returncode != 0 and all(c.ok for c in checks)):
            why = f"no answer within {timeout_s:.0f} s" if timed_out else f"exited with status {self.proc.returncode}"
            name = "one rank: process" if self.kind == "one" else "all ranks: torchrun"
            checks.append(Check(name, False, f"{why}: {_tail(out)}", time.monotonic() - self.t0))
        return checks

    def _merged(self, name: str, rows: list[dict], out: str) -> Check:
        failed = [r for r in rows if not r["ok"]]
        seconds = max(r["seconds"] for r in rows)
        if failed:
            more = f" (and {len(failed) - 1} more ranks)" if len(failed) > 1 else ""
            return Check(name, False, f"rank {failed[0]['rank']}: {failed[0]['detail']}{more}", seconds)
        if len(rows) < self.ranks:
            return Check(name, False, f"only {len(rows)} of {self.ranks} ranks answered: {_tail(out)}", seconds)
        return Check(name, True, min(rows, key=lambda r: r["rank"])["detail"], seconds)


def _tail(output: str, lines: int = 3) -> str:
    kept = [line for line in output.splitlines() if line.strip() and DOCTOR_PREFIX not in line]
    return " | ".join(kept[-lines:])


PARITY_RUN = "all ranks: parity run on the device"
"""The rank check whose outcome the parity smoke needs (``doctor_ranks.all_ranks``)."""


# The parity smoke --------------------------------------------------------------------------------


def _tiny_shape(pc: ParallelConfig) -> dict:
    """A tiny Llama every rank of ``pc`` can hold a part of: query heads, MLP width and
    vocabulary divisible by tp (grouped K/V heads replicated past 2), a layer per stage."""
    heads = pc.tp * math.ceil(4 / pc.tp)
    return dict(
        hidden_size=32 * heads,
        intermediate_size=88 * heads,
        num_attention_heads=heads,
        num_key_value_heads=2 if pc.tp == 1 or pc.tp % 2 == 0 else heads,
        num_hidden_layers=max(4, pc.pp * pc.virtual_stages),
    )


def _parity_model(target: DoctorTarget, work: Path) -> tuple[str, str]:
    """(model directory, how the detail names it): the run's model when it is local and small
    enough for one CPU process, else the tiny Llama shaped for the layout, built once per shape."""
    shape = target.shape() if target.model_dir else None
    if shape is not None and shape.num_parameters <= PARITY_MAX_PARAMETERS:
        return target.model_dir, f"{shape.name} ({shape.num_parameters / 1e6:.1f}M parameters)"
    from .tiny import make_tiny_llama

    fields = _tiny_shape(target.parallel)
    vocab = 2048 - 2048 % target.parallel.tp
    key = "-".join(f"{v}" for v in fields.values())
    out = work / f"tiny-llama-{key}-v{vocab}"
    if not (out / "config.json").is_file():
        tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=work))
        make_tiny_llama(tmp, vocab_size=vocab, **fields)
        try:
            tmp.rename(out)
        except OSError:  # another doctor built it meanwhile
            shutil.rmtree(tmp, ignore_errors=True)
    too_big = (
        f"; {shape.name} has {shape.num_parameters / 1e9:.1f}B parameters, too many for one CPU process"
        if shape
        else ""
    )
    return str(
        out
    ), f"a tiny Llama ({fields['num_hidden_layers']} layers, {fields['num_attention_heads']} heads){too_big}"


def parity_jobs(target: DoctorTarget) -> tuple[JobConfig, JobConfig, str]:
    """The parity smoke's two training jobs, fp32, same model, data, seed and global batch: the
    target's layout on its device, and one CPU process; and how to name their model. Their run
    directories (under ``work_dir``) are emptied of an earlier doctor's runs."""
    from .checkpoint.output import claim_run_dir, is_ours
    from .data import tokenize_dataset
    from .tiny import corpus_documents

    work = Path(target.work_dir).expanduser().resolve()
    work.mkdir(parents=True, exist_ok=True)
    model, described = _parity_model(target, work)
    corpus = work / "corpus.jsonl"
    if not corpus.is_file():
        tmp = corpus.with_name(f".corpus-{os.getpid()}.jsonl")
        tmp.write_text("".join(json.dumps({"text": d}) + "\n" for d in corpus_documents()[:16]))
        tmp.replace(corpus)
    pc = target.parallel
    block = math.lcm(32, pc.tp) if pc.sequence_parallel else 32
    dataset = tokenize_dataset(source=str(corpus), tokenizer_dir=model, block_size=block, cache_dir=work / "datasets")
    mbs = pc.num_microbatches * math.ceil(2 / pc.num_microbatches)
    train = TrainConfig(
        max_steps=PARITY_STEPS,
        save_every=0,
        keep_checkpoints=1,
        lr=3e-3,
        warmup_steps=1,
        seed=2,
        global_batch_size=mbs * pc.dp,
        micro_batch_size=mbs,
        report_to=[],
    )
    layer_split = pc.layer_split if model == target.model_dir else None
    jobs = []
    for name, parallel, launch in (
        ("parity-device", dataclasses.replace(pc, mixed_precision="fp32", layer_split=layer_split), target.launch),
        ("parity-cpu", ParallelConfig(mixed_precision="fp32"), LaunchConfig(device="cpu")),
    ):
        run_dir = work / name
        if run_dir.exists() and is_ours(run_dir):
            shutil.rmtree(run_dir)  # a run left there would be resumed, not trained
        claim_run_dir(run_dir)
        data = DataConfig(source=str(corpus), block_size=block)
        jobs.append(
            JobConfig(
                model_path=model,
                dataset_path=dataset.path,
                output_dir=str(run_dir),
                data=data,
                parallel=parallel,
                train=train,
                launch=launch,
            )
        )
    return jobs[0], jobs[1], described


def run_reference(job: JobConfig):
    """The parity smoke's CPU process (the training entry point under torchrun, one rank), with
    PyTorch's autoloading of device backends off: it must not claim an accelerator."""
    from .launch import run_torchrun

    return run_torchrun(job, job.launch, env={"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})


PARITY = f"parity smoke: {PARITY_STEPS} steps on the device vs one CPU process"


def parity_check(
    device_job: JobConfig, reference_job: JobConfig, model: str, device_run: Check | None, reference, seconds: float
) -> Check:
    """Compare every step's loss and gradient norm of the two runs (``metrics.jsonl``) within
    :data:`PARITY_RTOL`; ``device_run`` is the rank check of the device run, ``reference`` what
    :func:`run_reference` returned or raised."""
    from .reporting import read_metrics
    from .run_files import METRICS_FILE

    if device_run is None or not device_run.ok:
        why = device_run.detail if device_run else "the rank jobs never started it"
        return Check(PARITY, False, f"the device run failed: {why}", seconds)
    if isinstance(reference, Exception):
        return Check(PARITY, False, f"the CPU process failed: {first_line(reference)}", seconds)
    ours, ref = (read_metrics(Path(j.output_dir) / METRICS_FILE) for j in (device_job, reference_job))
    steps = list(range(1, PARITY_STEPS + 1))
    if [m["step"] for m in ours] != steps or [m["step"] for m in ref] != steps:
        return Check(
            PARITY,
            False,
            f"steps {[m['step'] for m in ours]} on the device, {[m['step'] for m in ref]} on CPU",
            seconds,
        )
    loss = max(abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(ours, ref))
    norm = max(abs(a["grad_norm"] - b["grad_norm"]) / abs(b["grad_norm"]) for a, b in zip(ours, ref))
    device = device_job.launch.device
    loss_tol, norm_tol = PARITY_RTOL[device]
    pc = device_job.parallel
    detail = (
        f"{model}, dp={pc.dp} tp={pc.tp} pp={pc.pp} on {device}, fp32: losses within {loss:.1e} "
        f"(bound {loss_tol:g}), gradient norms within {norm:.1e} (bound {norm_tol:g}) of one CPU process, relative"
    )
    return Check(PARITY, loss <= loss_tol and norm <= norm_tol, detail, seconds)


# Output ------------------------------------------------------------------------------------------


def to_json(checks: list[Check]) -> str:
    return json.dumps({"checks": [c.as_dict() for c in checks]}, indent=1)


def format_table(checks: list[Check]) -> str:
    """One line per check (ok or FAIL, name, seconds, detail), then how many failed."""
    width = max(len(c.name) for c in checks)
    lines = [f"{'ok' if c.ok else 'FAIL':4}  {c.name:<{width}}  {c.seconds:6.1f} s  {c.detail}" for c in checks]
    failed = sum(not c.ok for c in checks)
    lines.append(f"{len(checks)} checks, {failed} failed" if failed else f"{len(checks)} checks, all ok")
    return "\n".join(lines)
