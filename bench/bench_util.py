"""Process helpers shared by the benchmarks: child processes with an offline, quiet environment
and an optional CPU monitor, torchrun command lines, medians, load average, timestamped logs."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cpu_monitor import CpuMonitor  # bench/ is the running script's own directory, first on sys.path

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


def run_child(
    cmd: list[str],
    *,
    threads: int,
    timeout: float,
    label: str,
    extra_path: str | None = None,
    monitor: tuple[Path, str, int] | None = None,
) -> tuple[float, CpuMonitor | None]:
    """Run a child process; raise with its output on failure. Returns wall seconds and the CPU
    monitor (``monitor`` = per-step log, marker in the workers' command lines, number of workers)."""
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
        mon = CpuMonitor(proc.pid, *monitor) if monitor and sys.platform.startswith("linux") else None
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
            text = out.read().splitlines()
            first = next((i for i, x in enumerate(text) if "Traceback" in x), max(0, len(text) - 40))
            tail = "\n".join(text[first : first + 40] + ["..."] + text[-10:])
            raise RuntimeError(f"{label} failed (exit {code}):\n{tail}")
    return time.perf_counter() - t0, mon


def torchrun_cmd(nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def loadavg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)
