"""Run a script or module on local ranks under torchrun (standalone) and collect what came back:
the exit status, the output, the training entry point's progress events and what each rank
reported with :func:`print_rank_result`."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..config import LaunchConfig
from ..launch import read_event, read_tagged, torchrun_prefix
from ..procs import die_with_parent, kill_tree
from ..utils import write_line

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


def ranks_command(
    target: str | Path, nproc: int, args: list[str] | tuple[str, ...] = (), threads: int = 1
) -> list[str]:
    """torchrun (standalone, ``nproc`` ranks) running ``target``: a script path (``*.py``) or a
    module name (run with ``-m``), followed by ``args``."""
    target = str(target)
    program = [target] if target.endswith(".py") else ["-m", target]
    launch = LaunchConfig(nproc_per_node=nproc, omp_num_threads=threads)
    return torchrun_prefix(launch) + program + [str(a) for a in args]


class _Watcher:
    """``on_start(proc)`` in a thread next to the run; what it raises is kept for the caller."""

    def __init__(self, on_start: Callable[[subprocess.Popen], None], proc: subprocess.Popen) -> None:
        self.error: BaseException | None = None

        def watch() -> None:
            try:
                on_start(proc)
            except BaseException as e:  # re-raised in the caller once the run is over
                self.error = e

        self.thread = threading.Thread(target=watch, name="run_ranks-on_start", daemon=True)
        self.thread.start()

    def join(self) -> None:
        self.thread.join()
        if self.error is not None:
            raise self.error


def _communicate(proc: subprocess.Popen, timeout: float) -> tuple[str, str, bool]:
    """Both streams of ``proc`` once it has exited, and whether it ran past ``timeout`` (then
    every rank is ended first)."""
    try:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
            return stdout, stderr, False
        except subprocess.TimeoutExpired:
            kill_tree(proc, grace_s=5.0)
            stdout, stderr = proc.communicate()
            return stdout, stderr, True
    finally:
        kill_tree(proc)


def structured_lines(stdout: str) -> tuple[list[dict], list[dict]]:
    """The progress events and the rank results among the lines of ``stdout``."""
    events, results = [], []
    for line in stdout.splitlines():
        if (event := read_event(line)) is not None:
            events.append(event)
        elif (result := read_tagged(line, RESULT_PREFIX)) is not None:
            results.append(result)
    return events, results


def start_ranks(
    target: str | Path,
    nproc: int,
    args: list[str] | tuple[str, ...] = (),
    *,
    env: dict[str, str] | None = None,
    threads: int = 1,
    cwd: str | Path | None = None,
) -> subprocess.Popen:
    """Start torchrun with ``target`` on ``nproc`` local ranks (:func:`ranks_command`), both
    output streams piped as text, in its own session, ending with this process. The ranks get
    this process's environment, ``env`` over it, ``OMP_NUM_THREADS=threads`` and unbuffered
    output."""
    return subprocess.Popen(
        ranks_command(target, nproc, args, threads),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {}), "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"},
        cwd=cwd,
        start_new_session=True,
        preexec_fn=die_with_parent(os.getpid()),
    )


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
    """Run ``target`` on ``nproc`` local ranks under torchrun (standalone, :func:`ranks_command`)
    and return what came back. The ranks get ``OMP_NUM_THREADS=threads`` and unbuffered output on
    top of ``env``. On a timeout every rank is ended (``procs.kill_tree``) and the result has
    ``timed_out`` set and return code 124; nothing is raised for a failing run: check
    ``returncode``. ``on_start(proc)``, if given, runs in a thread next to the run once torchrun
    has started (to attach a monitor to its process tree, or to kill it at a chosen moment);
    what it raises is raised here after the run."""
    t0 = time.monotonic()
    proc = start_ranks(target, nproc, args, env=env, threads=threads, cwd=cwd)
    watcher = _Watcher(on_start, proc) if on_start else None
    stdout, stderr, timed_out = _communicate(proc, timeout)
    if watcher:
        watcher.join()
    events, results = structured_lines(stdout)
    return RanksResult(
        returncode=124 if timed_out else proc.returncode,
        stdout=stdout,
        stderr=stderr,
        events=events,
        results=results,
        timed_out=timed_out,
        seconds=time.monotonic() - t0,
    )
