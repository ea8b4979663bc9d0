"""Faults a long training run meets, each injected into a real two-rank torchrun job of the tiny
model: a rank killed while an asynchronous checkpoint is written (fault 2), a crash in the
middle of a synchronous write (3), a disk that fills during a save (5) and a rank that hangs
(10). Each test prints one ``FAULT`` line with what it measured (shown by ``pytest -s``) and
asserts it: steps lost, seconds until the job ended, processes left behind, data lost.

Faults are timed from outside, by watching the run directory and the output: when the moment
comes the ranks are frozen (SIGSTOP), the state on disk is checked to be the one wanted, and
only then is the fault injected, so no test depends on winning a race."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from neuron_parallel.checkpoint import is_complete, list_checkpoints, validate_checkpoint
from neuron_parallel.config import LaunchConfig
from neuron_parallel.launch import EVENT_PREFIX, torchrun_command
from neuron_parallel.procs import kill_tree, process_tree, start_time
from neuron_parallel.reporting import read_metrics

from ..conftest import ROOT, torchrun, write_job

pytestmark = pytest.mark.timeout(240)


class Run:
    """One torchrun job of ``job.json`` on two ranks, its output collected line by line with the
    time each arrived, and every process it started remembered (pid and start time)."""

    def __init__(self, job: Path) -> None:
        self.run_dir = job.parent
        cmd = torchrun_command(job, LaunchConfig(nproc_per_node=2))
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT, start_new_session=True
        )
        self.lines: list[tuple[float, str]] = []
        self.seen: dict[int, int] = {}  # pid -> start time, every process of the tree ever seen
        self.ranks: dict[int, int] = {}  # rank -> pid
        self.ended_at: float | None = None
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    @property
    def output(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def events(self, kind: str) -> list[tuple[float, dict]]:
        found = []
        for t, line in list(self.lines):
            at = line.find(EVENT_PREFIX)
            if at >= 0:
                event = json.loads(line[at + len(EVENT_PREFIX) :])
                if event["event"] == kind:
                    found.append((t, event))
        return found

    def event_at(self, kind: str, step: int) -> float | None:
        """When the ``kind`` event of ``step`` arrived, or None."""
        return next((t for t, e in self.events(kind) if e.get("step") == step), None)

    def _scan(self) -> None:
        for pid in process_tree(self.proc.pid):
            started = start_time(pid)
            if started is None:
                continue
            self.seen.setdefault(pid, started)
            if pid != self.proc.pid and pid not in self.ranks.values():
                rank = _env(pid).get("RANK")
                if rank is not None:
                    self.ranks[int(rank)] = pid

    def wait_for(self, ready: Callable[[], bool], what: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            self._scan()
            assert self.proc.poll() is None, f"the run ended before {what}:\n{self.output[-4000:]}"
            assert time.monotonic() < deadline, f"no {what} within {timeout} s"
            time.sleep(0.002)
        self._scan()

    def signal_ranks(self, sig: int) -> None:
        assert len(self.ranks) == 2, self.ranks
        for pid in self.ranks.values():
            os.kill(pid, sig)

    def finish(self, timeout: float = 150) -> int:
        """Wait for torchrun to end (killing it all after ``timeout``); its exit status."""
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(self.proc, grace_s=2)
            code = 124
        self.ended_at = time.monotonic()
        self._reader.join(timeout=10)
        return code

    def survivors(self, grace_s: float = 5.0) -> list[int]:
        """Processes of this run still alive ``grace_s`` after torchrun ended (a process that was
        sent SIGKILL may take a moment to go; zombies and reused pids are not counted)."""
        deadline = time.monotonic() + grace_s
        while True:
            alive = [pid for pid, started in self.seen.items() if start_time(pid) == started and _state(pid) != "Z"]
            if not alive or time.monotonic() > deadline:
                return alive
            time.sleep(0.05)


def _proc_stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _state(pid: int) -> str | None:
    fields = _proc_stat(pid)
    return fields[0] if fields else None


def _who(pids: list[int]) -> list[str]:
    """State, parent and command line of each process, for an assertion message."""
    out = []
    for pid in pids:
        fields = _proc_stat(pid) or ["?", "?"]
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            cmd = "?"
        out.append(f"{pid} state={fields[0]} ppid={fields[1]} {cmd[:160]}")
    return out


def _env(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def _job(run_dir: Path, tiny_world, tiny_dataset, *, timeout_s: float | None = None, **train) -> Path:
    """A two-rank job with ZeRO-1 (both ranks write optimizer shards) and ``launch.timeout_s``."""
    path = write_job(run_dir, tiny_world["model"], tiny_dataset.path, world=2, parallel=dict(zero_1=True), train=train)
    if timeout_s is not None:
        job = json.loads(path.read_text())
        job["launch"]["timeout_s"] = timeout_s
        path.write_text(json.dumps(job))
    return path


def _complete(run_dir: Path) -> list[int]:
    return [int(c.name.split("-")[1]) for c in list_checkpoints(run_dir) if is_complete(c)]


def _last_step(run_dir: Path) -> int:
    return max((r["step"] for r in read_metrics(run_dir / "metrics.jsonl")), default=0)


def _retry(job: Path) -> tuple[list[dict], int, int]:
    """Run ``job`` again in the same run directory (on the session's warm ranks: what is under test
    is what the faulted run left on disk): its events, the step it resumed from, its last step."""
    retry = torchrun(job, 2)
    assert retry.returncode == 0, retry.tail()
    resumed = [e["step"] for e in retry.events if e["event"] == "resumed"]
    return retry.events, (resumed[0] if resumed else 0), _last_step(job.parent)


@pytest.mark.slow
def test_fault2_rank_killed_while_async_checkpoint_is_written(tiny_world, tiny_dataset, tmp_path):
    every, steps = 5, 30
    job = _job(
        tmp_path, tiny_world, tiny_dataset, max_steps=steps, save_every=every, async_save=True, keep_checkpoints=0
    )
    run = Run(job)
    hit = None
    # The first save after checkpoint-5 whose write is still in flight once the ranks are frozen.
    for step in range(2 * every, steps, every):
        run.wait_for(lambda s=step: run.event_at("checkpoint", s) is not None, f"the checkpoint event of step {step}")
        run.signal_ranks(signal.SIGSTOP)
        tmp = tmp_path / f"checkpoint-{step}.tmp"
        # Rank 1's part still unwritten (no listing of it yet): the kill interrupts the write.
        if tmp.is_dir() and not (tmp / "rank_00001.json").exists() and step - every in _complete(tmp_path):
            hit = step
            break
        run.signal_ranks(signal.SIGCONT)
    assert hit is not None, "every asynchronous write finished before the ranks could be frozen"
    trained = _last_step(tmp_path)
    killed_at = time.monotonic()
    os.kill(run.ranks[1], signal.SIGKILL)
    os.kill(run.ranks[0], signal.SIGCONT)
    code = run.finish()
    detect_s = run.ended_at - killed_at
    orphans = run.survivors()
    assert code != 0 and orphans == [], (code, _who(orphans))
    assert hit not in _complete(tmp_path), "the interrupted checkpoint must not count as complete"
    previous = max(_complete(tmp_path))
    assert previous == hit - every and validate_checkpoint(tmp_path / f"checkpoint-{previous}") == []

    _, resumed, last = _retry(job)
    lost = trained - resumed
    print(
        f"FAULT 2 kill -9 rank 1 during async write of checkpoint-{hit}: steps lost {lost} (interval {every}), "
        f"detect {detect_s:.1f} s, orphan processes {len(orphans)}, resumed from {resumed}, finished at {last}, "
        f"data lost: checkpoint-{hit} (never complete)"
    )
    assert resumed == previous and last == steps
    # The write of a checkpoint overlaps at most the one step the ranks were frozen in.
    assert lost <= every + 1, (trained, resumed)
    assert (tmp_path / f"checkpoint-{hit}").is_dir() and is_complete(tmp_path / f"checkpoint-{hit}")


def test_fault3_crash_during_sync_checkpoint_write_leaves_a_partial_that_is_ignored(tiny_world, tiny_dataset, tmp_path):
    every, steps = 5, 25
    job = _job(tmp_path, tiny_world, tiny_dataset, max_steps=steps, save_every=every, keep_checkpoints=0)
    run = Run(job)
    run.wait_for(lambda: every in _complete(tmp_path), f"checkpoint-{every}")
    hit = None
    for step in range(2 * every, steps, every):
        tmp = tmp_path / f"checkpoint-{step}.tmp"
        run.wait_for(lambda t=tmp, s=step: t.is_dir() or s in _complete(tmp_path), f"checkpoint-{step}.tmp")
        run.signal_ranks(signal.SIGSTOP)
        if tmp.is_dir():
            hit = step
            break
        run.signal_ranks(signal.SIGCONT)
    assert hit is not None, "every synchronous write finished before the ranks could be frozen"
    partial = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*"))
    trained = _last_step(tmp_path)
    for pid in process_tree(run.proc.pid):  # the machine going down: torchrun and every rank at once
        os.kill(pid, signal.SIGKILL)
    code = run.finish()
    orphans = run.survivors()
    assert code != 0 and orphans == [], (code, _who(orphans))
    assert tmp.is_dir() and hit not in _complete(tmp_path)
    previous = max(_complete(tmp_path))
    assert previous == hit - every and validate_checkpoint(tmp_path / f"checkpoint-{previous}") == []

    events, resumed, last = _retry(job)
    warnings = [e["message"] for e in events if e["event"] == "warning"]
    leftovers = sorted(p.name for p in tmp_path.glob("checkpoint-*.tmp"))
    print(
        f"FAULT 3 crash during sync write of checkpoint-{hit} ({len(partial)} entries written): steps lost "
        f"{trained - resumed} (interval {every}), orphan processes {len(orphans)}, resumed from {resumed}, "
        f"finished at {last}, partial removed on retry: {any(tmp.name in w for w in warnings)}, "
        f".tmp left: {leftovers}, data lost: checkpoint-{hit} (never complete)"
    )
    assert resumed == previous and last == steps and trained - resumed <= every
    assert any(tmp.name in w for w in warnings), warnings
    assert leftovers == [] and hit in _complete(tmp_path)


FILE_LIMIT = 1 << 20
"""RLIMIT_FSIZE for the failing rank: above what it writes outside checkpoints (a rank listing is
a few kB), below its optimizer shard (about 5 MB for the tiny model under ZeRO-1)."""


def test_fault5_disk_full_during_async_save_stops_the_run_within_a_step(tiny_world, tiny_dataset, tmp_path):
    every, steps = 5, 20
    job = _job(
        tmp_path, tiny_world, tiny_dataset, max_steps=steps, save_every=every, async_save=True, keep_checkpoints=0
    )
    run = Run(job)
    run.wait_for(lambda: every in _complete(tmp_path), f"checkpoint-{every}")
    run.signal_ranks(signal.SIGSTOP)
    assert not list(tmp_path.glob(f"checkpoint-{2 * every}*")), "the next save began before the limit was set"
    # The disk fills up for rank 1 only: its next shard write fails with EFBIG (Python ignores
    # SIGXFSZ), and rank 0, whose writes succeed, must stop all the same.
    _, hard = resource.prlimit(run.ranks[1], resource.RLIMIT_FSIZE)
    resource.prlimit(run.ranks[1], resource.RLIMIT_FSIZE, (FILE_LIMIT, hard))
    run.signal_ranks(signal.SIGCONT)
    code = run.finish()
    failed = 2 * every
    detect_s = run.ended_at - run.event_at("checkpoint", failed)
    trained = _last_step(tmp_path)
    orphans = run.survivors()
    out = run.output
    message = next((line for line in out.splitlines() if "could not be saved" in line), "")
    assert code != 0 and orphans == [], (code, _who(orphans), out[-4000:])
    assert f"checkpoint-{failed} could not be saved" in message and "File too large" in message, out[-4000:]
    assert "free disk space" in message and f"resumes from checkpoint-{every}" in message, message
    assert _complete(tmp_path) == [every] and validate_checkpoint(tmp_path / f"checkpoint-{every}") == []

    _, resumed, last = _retry(job)
    print(
        f"FAULT 5 disk full (EFBIG on rank 1) during async save of checkpoint-{failed}: stopped after step "
        f"{trained} ({trained - failed} step(s) after the failing save), detect {detect_s:.1f} s, orphan "
        f"processes {len(orphans)}, checkpoint-{every} valid, resumed from {resumed}, finished at {last}, "
        f"steps lost {trained - resumed}, data lost: checkpoint-{failed} (never complete) | {message[:240]}"
    )
    assert trained - failed <= 1
    assert resumed == every and last == steps
    assert validate_checkpoint(tmp_path / f"checkpoint-{steps}") == []


TIMEOUT_S = 10
TORCHRUN_GRACE_S = 30
"""How long torchrun waits for a rank it sent SIGTERM before it sends SIGKILL (fixed in torch
2.13's failure path). A stopped rank keeps SIGTERM pending (POSIX delivers nothing but SIGKILL
to a stopped process), so a hung rank is gone only after this grace."""


def test_fault10_hung_rank_ends_the_job_within_the_timeout(tiny_world, tiny_dataset, tmp_path):
    every, steps = 5, 40
    job = _job(
        tmp_path, tiny_world, tiny_dataset, timeout_s=TIMEOUT_S, max_steps=steps, save_every=every, keep_checkpoints=0
    )
    run = Run(job)
    run.wait_for(lambda: every in _complete(tmp_path), f"checkpoint-{every}")
    stopped_at = time.monotonic()
    os.kill(run.ranks[1], signal.SIGSTOP)  # hangs: alive, holding its connections, never answering
    code = run.finish(timeout=TIMEOUT_S + 90)
    detect_s = run.ended_at - stopped_at
    orphans = run.survivors()
    trained = _last_step(tmp_path)
    out = run.output
    message = next((line for line in out.splitlines() if "launch.timeout_s" in line), "")
    for pid in orphans:  # leave nothing behind, even when the test fails
        os.kill(pid, signal.SIGKILL)
    assert code not in (0, 124) and orphans == [], (code, _who(orphans), out[-4000:])
    assert f"launch.timeout_s={TIMEOUT_S}" in message, out[-4000:]
    previous = max(_complete(tmp_path))

    _, resumed, last = _retry(job)
    print(
        f"FAULT 10 rank 1 SIGSTOPped, launch.timeout_s={TIMEOUT_S}: job ended after {detect_s:.1f} s "
        f"(exit {code}), orphan processes {len(orphans)}, steps lost {trained - resumed} (interval {every}), "
        f"resumed from {resumed}, finished at {last}, data lost: none past checkpoint-{previous} | {message[:200]}"
    )
    assert detect_s <= TIMEOUT_S + TORCHRUN_GRACE_S + 15
    assert resumed == previous and last == steps and trained - resumed <= every + 1


def test_every_mesh_group_waits_launch_timeout_s(tmp_path):
    """DeviceMesh creates its axis groups itself; each one gets ``launch.timeout_s`` too."""
    script = (
        "import torch, torch.distributed as dist\n"
        "from neuron_parallel.mesh import ParallelDims, init_distributed\n"
        "init_distributed('cpu', timeout_s=7)\n"
        "mesh = ParallelDims(dp=1, pp=1, tp=1, timeout_s=7).mesh\n"
        "groups = [dist.group.WORLD] + [mesh[a].get_group() for a in ('dp', 'pp', 'tp')]\n"
        "print([g._get_backend(torch.device('cpu')).options._timeout.total_seconds() for g in groups])\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env = {k: v for k, v in env.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120, check=True
    )
    assert out.stdout.strip().splitlines()[-1] == "[7.0, 7.0, 7.0, 7.0]", out.stdout + out.stderr
