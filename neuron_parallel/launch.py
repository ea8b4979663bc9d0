"""Start training as a supervised torchrun process tree.

torchrun runs in its own process group (session), so cancelling the caller, a Ctrl-C or an
exception ends every rank: the group is signalled in a ``finally``, SIGTERM first, SIGKILL after
a grace period (``procs.kill_tree``). If the caller dies without running its ``finally`` (SIGKILL,
or a signal whose default action ends it), the kernel sends torchrun SIGTERM
(``procs.die_with_parent``) and torchrun ends its ranks. Structured lines from rank 0
(``EVENT_PREFIX``) become events for the caller; everything else is passed through as log lines.

A command that spends seconds before its job is known (the flow's server start, tokenization,
planning) can start torchrun at once with :func:`start_ready_ranks`: each rank imports torch,
transformers and the trainer (most of a rank's start on a small model) and then waits for the
job file; the next :func:`run_torchrun` with the same launch settings hands the job to those ranks
instead of starting new ones.

Across nodes, the first node writes its job and launch settings to shared storage
(:func:`publish_launch`) and every other node's :func:`join` reads them and starts its own
torchrun agent in the same rendezvous.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .checkpoint.output import claim_run_dir
from .config import JobConfig, LaunchConfig
from .procs import die_with_parent, kill_tree
from .run_files import JOB_FILE

EVENT_PREFIX = "@@neuron-flows "
"""What starts a progress event's line in a rank's output: one JSON object follows (``neuron_parallel.train``)."""


class TrainingFailed(RuntimeError):
    """torchrun exited non-zero; the message carries the last lines it printed."""


@dataclass(frozen=True, slots=True)
class TrainResult:
    run_dir: str
    final_step: int
    resumed_from_step: int
    last_metrics: dict


def read_tagged(line: str, prefix: str) -> dict | None:
    """The JSON object a structured line carries after ``prefix``, or None. Ranks share one pipe
    and write a structured line, newline included, in one atomic write (``utils.write_line``),
    but another rank's ``print`` may have written its text and not yet its newline, so the
    structured part can follow foreign text on the same line: it is always the line's tail."""
    at = line.rfind(prefix)
    if at < 0:
        return None
    try:
        obj = json.loads(line[at + len(prefix) :])
    except json.JSONDecodeError:
        return None
    return obj if isinstance(obj, dict) else None


def read_event(line: str) -> dict | None:
    """The progress event a line carries, or None for any other line, including an event line
    that another process's output broke into: that is output, not a reason to fail the run."""
    event = read_tagged(line, EVENT_PREFIX)
    return event if event is not None and "event" in event else None


AWAIT_JOB = "--await-job"
"""The rank's option that makes it wait for its job file to appear (:class:`ReadyRanks`)."""


def torchrun_prefix(launch: LaunchConfig) -> list[str]:
    """torchrun and its options, up to the program it runs: standalone on one node, c10d
    rendezvous across several."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={launch.nproc_per_node}"]
    if launch.nnodes == 1:
        return cmd + ["--standalone"]
    return cmd + [
        f"--nnodes={launch.nnodes}",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint={launch.rdzv_endpoint}",
        f"--rdzv_id={launch.rdzv_id}",
    ]


def torchrun_command(job_path: str | Path, launch: LaunchConfig, *, await_job: bool = False) -> list[str]:
    """The torchrun command line of a training job (``neuron_parallel.train``). ``await_job``:
    the ranks wait for ``job_path`` to be written."""
    return torchrun_prefix(launch) + ["-m", "neuron_parallel.train", *([AWAIT_JOB] if await_job else []), str(job_path)]


def run_torchrun(
    job: JobConfig,
    launch: LaunchConfig,
    *,
    on_event: Callable[[dict], None] | None = None,
    on_line: Callable[[str], None] | None = None,
    env: dict[str, str] | None = None,
) -> TrainResult:
    """Write ``job.json`` into the run directory (claimed first: new, empty or created by
    neuron-flows, see ``checkpoint/output.py``), run torchrun to completion and return what
    the run reports. Raises ``TrainingFailed`` on a non-zero exit. Ranks that
    :func:`start_ready_ranks` started with the same ``launch`` and ``env`` get the job, if they
    are still waiting for one; otherwise torchrun starts here."""
    run_dir = claim_run_dir(job.output_dir)  # new, empty or this tool's: refused before job.json is written
    job_path = run_dir / JOB_FILE
    # Atomic: on a shared run directory every node's launcher writes the same job, while ranks
    # that already started may be reading it.
    tmp = job_path.with_name(f"{JOB_FILE}.tmp-{os.getpid()}")
    tmp.write_text(job.to_json())
    tmp.replace(job_path)
    tail: deque[str] = deque(maxlen=40)
    state = {"final_step": 0, "resumed_from_step": 0, "last_metrics": {}}
    ready = _take_ready_ranks(launch, env)
    proc = ready.give(job) if ready is not None else start_torchrun(torchrun_command(job_path, launch), launch, env)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip("\n")
            event = read_event(line)
            if event is not None and not line.startswith(EVENT_PREFIX):  # another rank's text first
                line = line[: line.rfind(EVENT_PREFIX)]
                tail.append(line)
                if on_line:
                    on_line(line)
            if event is not None:
                if event["event"] == "step":
                    state["final_step"] = event["step"]
                    state["last_metrics"] = event
                elif event["event"] == "resumed":
                    state["resumed_from_step"] = event["step"]
                    state["final_step"] = event["step"]
                if on_event:
                    on_event(event)
            else:
                tail.append(line)
                if on_line:
                    on_line(line)
        code = proc.wait()
    finally:
        kill_tree(proc)
        if ready is not None:
            ready.close()
    if code != 0:
        raise TrainingFailed(f"torchrun exited with code {code}; last output:\n" + "\n".join(tail))
    return TrainResult(run_dir=str(run_dir), **state)


def start_torchrun(cmd: list[str], launch: LaunchConfig, env: dict[str, str] | None) -> subprocess.Popen:
    """torchrun in a session of its own, its output (ranks' included) merged on one pipe."""
    child_env = {**os.environ, **(env or {}), "OMP_NUM_THREADS": str(launch.omp_num_threads), "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=child_env,
        start_new_session=True,
        preexec_fn=die_with_parent(os.getpid()),
    )


class ReadyRanks:
    """torchrun and its ranks, started before their job is known; each rank waits for the job
    file once it has imported what it needs (``neuron_parallel.train --await-job``). Single node
    only: a multi-node rendezvous waits for the other nodes anyway."""

    def __init__(self, launch: LaunchConfig, env: dict[str, str] | None = None) -> None:
        self.launch, self.env = launch, env
        self.dir = Path(tempfile.mkdtemp(prefix="neuron-flows-ranks-"))
        self.job_path = self.dir / JOB_FILE
        self.proc = start_torchrun(torchrun_command(self.job_path, launch, await_job=True), launch, env)

    def give(self, job: JobConfig) -> subprocess.Popen:
        """Hand ``job`` to the waiting ranks (written atomically: a rank never reads half a file);
        returns torchrun's process, whose output holds everything the ranks printed so far."""
        tmp = self.job_path.with_name(f"{JOB_FILE}.tmp")
        tmp.write_text(job.to_json())
        tmp.replace(self.job_path)
        return self.proc

    def close(self) -> None:
        """End torchrun and the ranks if they still run, and remove the job file."""
        global _ready
        if _ready is self:
            _ready = None
        kill_tree(self.proc)
        shutil.rmtree(self.dir, ignore_errors=True)


_ready: ReadyRanks | None = None


def start_ready_ranks(launch: LaunchConfig, env: dict[str, str] | None = None) -> ReadyRanks | None:
    """Start torchrun and its ranks for the next :func:`run_torchrun` of this process with the
    same ``launch`` and ``env`` (None for a multi-node launch). The caller ends them with
    :meth:`ReadyRanks.close` if no job comes (``run_torchrun`` closes those it used)."""
    global _ready
    if launch.nnodes != 1:
        return None
    if _ready is not None:
        _ready.close()
    _ready = ReadyRanks(launch, env)
    return _ready


def _take_ready_ranks(launch: LaunchConfig, env: dict[str, str] | None) -> ReadyRanks | None:
    """The ready ranks for this launch, if they are still waiting (each set serves one job)."""
    global _ready
    ready, _ready = _ready, None
    if ready is None:
        return None
    if ready.launch == launch and ready.env == env and ready.proc.poll() is None:
        return ready
    ready.close()  # started for other settings, or ended while waiting: a fresh start reports why
    return None


LAUNCH_FILE_ENV = "NEURON_FLOWS_LAUNCH_FILE"
"""Where the first node publishes a multi-node launch for the others (``join``)."""


def publish_launch(path: str | Path, job: JobConfig, launch: LaunchConfig) -> None:
    """Write the job and the launch settings where the other nodes' ``join`` waits for them
    (a shared file system); atomic, so a reader never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps({"job": json.loads(job.to_json()), "launch": dataclasses.asdict(launch)}))
    tmp.replace(path)


def join(path: str | Path, *, timeout_s: float = 6 * 3600, poll_s: float = 2.0, **kwargs) -> TrainResult:
    """On a node other than the first: wait for the launch ``publish_launch`` writes at ``path``,
    then start this node's torchrun agent in the same c10d rendezvous (``run_torchrun``)."""
    path = Path(path)
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"no launch appeared at {path} within {timeout_s:.0f} s; is the first node running "
                f"the flow, and is {path.parent} on a file system both nodes share?"
            )
        time.sleep(poll_s)
    data = json.loads(path.read_text())
    return run_torchrun(JobConfig.from_dict(data["job"]), LaunchConfig(**data["launch"]), **kwargs)
