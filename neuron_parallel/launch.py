"""Start training as a supervised torchrun process tree.

torchrun runs in its own process group (session), so cancelling the caller, a Ctrl-C or an
exception ends every rank: the group is signalled in a ``finally``, SIGTERM first, SIGKILL after
a grace period. If the caller dies without running its ``finally`` (SIGKILL, or a signal whose
default action ends it), the kernel sends torchrun SIGTERM (``die_with_parent``) and torchrun
ends its ranks. Structured lines from rank 0 (``EVENT_PREFIX``) become events for the
caller; everything else is passed through as log lines.

A command that spends seconds before its job is known (the flow's server start, tokenization,
planning) can start torchrun at once with :func:`start_ready_ranks`: each rank imports torch,
transformers and the trainer (most of a rank's start on a small model) and then waits for the
job file; the next :func:`run_torchrun` with the same launch settings hands the job to those ranks
instead of starting new ones.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .config import JobConfig, LaunchConfig
from .utils import write_line

EVENT_PREFIX = "@@neuron-flows "
"""What starts a progress event's line in a rank's output: one JSON object follows (``neuron_parallel.train``)."""

_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None
_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> Callable[[], None] | None:
    """A ``preexec_fn`` for a child that must not outlive this process, or None where the kernel
    has no parent-death signal (Linux only). The child gets SIGTERM when the thread that started
    it ends, however it ends, SIGKILL included; a parent already gone by the time the child runs
    the call is caught by comparing ``parent_pid``. The C library is loaded here, before the
    fork, so between fork and exec the child makes only the one foreign call."""
    if _LIBC is None:
        return None

    def preexec() -> None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent_pid:
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


class TrainingFailed(RuntimeError):
    """torchrun exited non-zero; the message carries the last lines it printed."""


@dataclass(frozen=True, slots=True)
class TrainResult:
    run_dir: str
    final_step: int
    resumed_from_step: int
    last_metrics: dict


def _tagged(line: str, prefix: str) -> dict | None:
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


def _event(line: str) -> dict | None:
    """The progress event a line carries, or None for any other line, including an event line
    that another process's output broke into: that is output, not a reason to fail the run."""
    event = _tagged(line, EVENT_PREFIX)
    return event if event is not None and "event" in event else None


AWAIT_JOB = "--await-job"
"""The rank's option that makes it wait for its job file to appear (:class:`ReadyRanks`)."""


def torchrun_command(job_path: str | Path, launch: LaunchConfig, *, await_job: bool = False) -> list[str]:
    """The torchrun command line: standalone on one node, c10d rendezvous across several.
    ``await_job``: the ranks wait for ``job_path`` to be written."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={launch.nproc_per_node}"]
    if launch.nnodes == 1:
        cmd.append("--standalone")
    else:
        cmd += [
            f"--nnodes={launch.nnodes}",
            "--rdzv_backend=c10d",
            f"--rdzv_endpoint={launch.rdzv_endpoint}",
            f"--rdzv_id={launch.rdzv_id}",
        ]
    return cmd + ["-m", "neuron_parallel.train", *([AWAIT_JOB] if await_job else []), str(job_path)]


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants, from /proc (Linux); just ``pid`` where /proc is absent."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc") if os.path.isdir("/proc") else ():
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                # The command name is in parentheses and may hold spaces; ppid follows it.
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(children.get(p, []))
    return tree


def alive(pid: int) -> bool:
    """Whether process ``pid`` is running: it exists and has not exited (a zombie, waiting to be
    reaped, has), from /proc (Linux)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def kill_tree(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """End torchrun and every rank. torchrun (torch 2.13) starts each rank in a session of its
    own, so signalling torchrun's process group does not reach the ranks: SIGTERM goes to
    torchrun, which forwards it to the ranks; whatever is left after ``grace_s`` is SIGKILLed
    by pid, from a list of descendants taken before anything was signalled."""
    if proc.poll() is not None:
        return
    tree = process_tree(proc.pid)
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def run_torchrun(
    job: JobConfig,
    launch: LaunchConfig,
    *,
    on_event: Callable[[dict], None] | None = None,
    on_line: Callable[[str], None] | None = None,
    env: dict[str, str] | None = None,
) -> TrainResult:
    """Write ``job.json`` into the run directory, run torchrun to completion and return what
    the run reports. Raises ``TrainingFailed`` on a non-zero exit. Ranks that
    :func:`start_ready_ranks` started with the same ``launch`` and ``env`` get the job, if they
    are still waiting for one; otherwise torchrun starts here."""
    run_dir = Path(job.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    job_path = run_dir / "job.json"
    # Atomic: on a shared run directory every node's launcher writes the same job, while ranks
    # that already started may be reading it.
    tmp = job_path.with_name(f"job.json.tmp-{os.getpid()}")
    tmp.write_text(job.to_json())
    tmp.replace(job_path)
    tail: deque[str] = deque(maxlen=40)
    state = {"final_step": 0, "resumed_from_step": 0, "last_metrics": {}}
    ready = _take_ready_ranks(launch, env)
    proc = ready.give(job) if ready is not None else _start_torchrun(torchrun_command(job_path, launch), launch, env)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip("\n")
            event = _event(line)
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


def _start_torchrun(cmd: list[str], launch: LaunchConfig, env: dict[str, str] | None) -> subprocess.Popen:
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
        self.job_path = self.dir / "job.json"
        self.proc = _start_torchrun(torchrun_command(self.job_path, launch, await_job=True), launch, env)

    def give(self, job: JobConfig) -> subprocess.Popen:
        """Hand ``job`` to the waiting ranks (written atomically: a rank never reads half a file);
        returns torchrun's process, whose output holds everything the ranks printed so far."""
        tmp = self.job_path.with_name("job.json.tmp")
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


RESULT_PREFIX = "@@neuron-ranks "
"""A line a rank prints to report a result to ``run_ranks``: the prefix, then one JSON object
(``{"rank": r, ...}``); ``print_rank_result`` writes it."""


def print_rank_result(result: dict) -> None:
    """Report ``result`` (a JSON-able dict, given this rank's ``"rank"`` if it has none) to
    ``run_ranks``: one line in one write, so no other rank's output splits it."""
    if "rank" not in result:
        result = {"rank": int(os.environ.get("RANK", "0")), **result}
    write_line(RESULT_PREFIX + json.dumps(result))


@dataclass(frozen=True, slots=True)
class RanksResult:
    """What ``run_ranks`` saw: the exit status, the whole output, and the structured lines in it
    (``events``: the training entry point's ``EVENT_PREFIX`` lines; ``results``: every rank's
    ``RESULT_PREFIX`` lines, in the order printed)."""

    returncode: int
    stdout: str
    stderr: str
    events: list[dict]
    results: list[dict]
    timed_out: bool = False
    seconds: float = 0.0

    @property
    def by_rank(self) -> dict[int, list[dict]]:
        out: dict[int, list[dict]] = {}
        for r in self.results:
            out.setdefault(int(r["rank"]), []).append(r)
        return out

    def tail(self, chars: int = 6000) -> str:
        """The end of both streams, for an assertion message."""
        head = f"rc={self.returncode} timed_out={self.timed_out}"
        return f"{head}\n--- stdout\n{self.stdout[-chars:]}\n--- stderr\n{self.stderr[-chars:]}"


def run_ranks(
    target: str | Path,
    nproc: int,
    args: list[str] | tuple[str, ...] = (),
    *,
    env: dict[str, str] | None = None,
    timeout: float = 300,
    threads: int = 1,
    cwd: str | Path | None = None,
    on_start: Callable[[subprocess.Popen], None] | None = None,
) -> RanksResult:
    """Run ``target`` on ``nproc`` local ranks under torchrun (standalone) and return what came
    back. ``target`` is a script path (``*.py``) or a module name (run with ``-m``). The ranks get
    ``OMP_NUM_THREADS=threads`` and unbuffered output on top of ``env``. On a timeout every rank
    is ended (``kill_tree``) and the result has ``timed_out`` set and return code 124; nothing
    is raised for a failing run: check ``returncode``. ``on_start(proc)``, if given, runs in a
    thread next to the run once torchrun has started (to attach a monitor to its process tree,
    or to kill it at a chosen moment); what it raises is raised here after the run."""
    launch = LaunchConfig(nproc_per_node=nproc, omp_num_threads=threads)
    cmd = torchrun_command("JOB", launch)
    assert cmd[-3:] == ["-m", "neuron_parallel.train", "JOB"], cmd
    target = str(target)
    cmd = cmd[:-3] + ([target] if target.endswith(".py") else ["-m", target]) + [str(a) for a in args]
    child_env = {**os.environ, **(env or {}), "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    t0 = time.monotonic()
    pipe = subprocess.PIPE
    proc = subprocess.Popen(
        cmd,
        stdout=pipe,
        stderr=pipe,
        text=True,
        env=child_env,
        cwd=cwd,
        start_new_session=True,
        preexec_fn=die_with_parent(os.getpid()),
    )
    timed_out, watcher_error = False, []
    watcher = None
    if on_start:

        def watch() -> None:
            try:
                on_start(proc)
            except BaseException as e:  # re-raised in the caller once the run is over
                watcher_error.append(e)

        watcher = threading.Thread(target=watch, name="run_ranks-on_start", daemon=True)
        watcher.start()
    try:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            kill_tree(proc, grace_s=5.0)
            stdout, stderr = proc.communicate()
    finally:
        kill_tree(proc)
    if watcher:
        watcher.join()
        if watcher_error:
            raise watcher_error[0]
    events, results = [], []
    for line in stdout.splitlines():
        if (event := _event(line)) is not None:
            events.append(event)
        elif (result := _tagged(line, RESULT_PREFIX)) is not None:
            results.append(result)
    return RanksResult(
        returncode=124 if timed_out else proc.returncode,
        stdout=stdout,
        stderr=stderr,
        events=events,
        results=results,
        timed_out=timed_out,
        seconds=time.monotonic() - t0,
    )
