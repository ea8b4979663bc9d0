"""Process helpers shared by the benchmarks: child processes with an offline, quiet environment
and an optional CPU monitor, torchrun launches through ``neuron_parallel.launch.run_ranks``,
medians, load average, timestamped logs."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cpu_monitor import CpuMonitor  # bench/ is on sys.path (the running script's folder)

from neuron_parallel.launch import RanksResult, run_ranks

ROOT = Path(__file__).resolve().parents[1]


def child_env(threads: int, extra_path: str | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS=str(threads),
        PYTHONUNBUFFERED="1",
        HF_HUB_DISABLE_TELEMETRY="1",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_HUB_DISABLE_PROGRESS_BARS="1",
        HF_DATASETS_DISABLE_PROGRESS_BARS="1",
        TRANSFORMERS_VERBOSITY="error",
        TOKENIZERS_PARALLELISM="false",
    )
    paths = [str(ROOT)] + ([extra_path] if extra_path else []) + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def _failure(label: str, code, output: str) -> RuntimeError:
    """The error a failed child raises: its first traceback (or its last 40 lines) and its end."""
    text = output.splitlines()
    first = next((i for i, x in enumerate(text) if "Traceback" in x), max(0, len(text) - 40))
    tail = "\n".join(text[first : first + 40] + ["..."] + text[-10:])
    return RuntimeError(f"{label} failed (exit {code}):\n{tail}")


def _monitor(proc_pid: int, monitor: tuple[Path, str, int] | None) -> CpuMonitor | None:
    return CpuMonitor(proc_pid, *monitor) if monitor and sys.platform.startswith("linux") else None


def run_child(
    cmd: list[str],
    *,
    threads: int,
    timeout: float,
    label: str,
    extra_path: str | None = None,
    monitor: tuple[Path, str, int] | None = None,
) -> tuple[float, CpuMonitor | None]:
    """Run a single child process (not torchrun: that is ``run_ranks_child``); raise with its output
    on failure. Returns wall seconds and the CPU monitor (``monitor`` = per-step log, marker in the
    workers' command lines, number of workers)."""
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=child_env(threads, extra_path),
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        mon = _monitor(proc.pid, monitor)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            code = "timeout"
        finally:
            if mon:
                mon.stop()
        if code != 0:
            out.seek(0)
            raise _failure(label, code, out.read())
    return time.perf_counter() - t0, mon


def run_ranks_child(
    target: str | Path,
    nproc: int,
    args: list[str] | tuple[str, ...] = (),
    *,
    threads: int,
    timeout: float,
    label: str,
    extra_path: str | None = None,
    monitor: tuple[Path, str, int] | None = None,
) -> tuple[RanksResult, CpuMonitor | None]:
    """``target`` (a script or module) on ``nproc`` local ranks through the project's launcher
    (``neuron_parallel.launch.run_ranks``: torchrun standalone) in the environment of
    ``child_env``; raise with its output on failure. Returns the launcher's result (``seconds``:
    the run's wall time; ``results``: what the ranks reported with ``print_rank_result``) and
    the CPU monitor of its workers (``monitor`` as for ``run_child``), attached to torchrun's
    process tree as soon as torchrun has started."""
    monitors: list[CpuMonitor] = []

    def attach(proc: subprocess.Popen) -> None:
        mon = _monitor(proc.pid, monitor)
        if mon:
            monitors.append(mon)

    res = run_ranks(
        target,
        nproc,
        args,
        env=child_env(threads, extra_path),
        timeout=timeout,
        threads=threads,
        cwd=ROOT,
        on_start=attach if monitor else None,
    )
    mon = monitors[0] if monitors else None
    if mon:
        mon.stop()
    if res.returncode != 0:
        code = "timeout" if res.timed_out else res.returncode
        raise _failure(label, code, res.stdout + "\n" + res.stderr)
    return res, mon


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def loadavg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)
