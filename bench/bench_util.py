"""The harness every benchmark shares: its command line (``--quick`` included), child processes
with an offline, quiet environment, torchrun launches through
``neuron_parallel.testing.ranks.run_ranks``, the scheduler statistics that tell other people's
load apart from the code's own cost (``CpuMonitor`` and the ``/proc`` readers), and the output:
timestamped logs, medians, load average, result tables and the JSON results file."""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

if "HF_DATASETS_CACHE" not in os.environ:
    # datasets keeps an Arrow copy of every local file it loads in its cache: for a benchmark's
    # generated data, a temporary folder (it and the benchmark's children use it, removed at exit),
    # not the user's ~/.cache/huggingface/datasets. Set before anything imports datasets.
    os.environ["HF_DATASETS_CACHE"] = tempfile.mkdtemp(prefix="np-bench-datasets-")
    atexit.register(shutil.rmtree, os.environ["HF_DATASETS_CACHE"], ignore_errors=True)

from neuron_parallel.procs import cmdline, process_tree
from neuron_parallel.testing.ranks import RanksResult, run_ranks

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
"""Where every benchmark writes its JSON results (``write_results``)."""

# --------------------------------------------------------------------------------------------
# command line


def parser(doc: str, quick: str) -> argparse.ArgumentParser:
    """A benchmark's argument parser: described by the first paragraph of ``doc`` (its module
    docstring), with ``--quick``, whose help ``quick`` says what the quick run leaves out.
    ``make bench BENCH_ARGS=--quick`` gives it to every benchmark. A quick run shows that the
    benchmark starts and finishes; its goals are set for the full sizes."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help=f"a short run ({quick}); the goals are set for a full run")
    return ap


def pick(value, quick: bool, quick_value, full_value):
    """``value`` if the command line gave one (not None), else the quick or the full default."""
    if value is not None:
        return value
    return quick_value if quick else full_value


# --------------------------------------------------------------------------------------------
# child processes


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
    (``neuron_parallel.testing.ranks.run_ranks``: torchrun standalone) in the environment of
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


# --------------------------------------------------------------------------------------------
# scheduler statistics from /proc (Linux)


def thread_waits_ns(pid: int | str = "self") -> dict[str, int]:
    """Nanoseconds each thread of ``pid`` has waited, runnable, for a core held by another
    process (``/proc/PID/task/TID/schedstat``); threads that cannot be read are left out."""
    out = {}
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out[task.name] = int((task / "schedstat").read_text().split()[1])
        except (OSError, IndexError, ValueError):
            pass
    return out


def sched_ns(pid: int) -> tuple[int, int]:
    """(on-CPU ns of every thread of ``pid``, ns its main thread waited runnable for a core),
    from ``/proc/PID/task/TID/schedstat``."""
    total, queued = 0, 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
            run_ns, wait_ns = (int(x) for x in f.read().split()[:2])
        total += run_ns
        if tid == str(pid):
            queued = wait_ns
    return total, queued


def cpu_seconds(pid: int) -> float:
    """User + system seconds of ``pid``, its ended threads included (/proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_status(pid: int) -> dict[str, int]:
    """The memory lines of ``/proc/PID/status`` (VmHWM, VmRSS, RssAnon, RssFile, RssShmem), in
    kB; empty once the process is gone."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem"):
                    out[k] = int(v.split()[0])  # kB
    except (FileNotFoundError, ProcessLookupError, ValueError):
        pass
    return out


class CpuMonitor:
    """Samples the scheduler statistics of a run's worker processes (the ranks, not torchrun's
    agent) each time the run's per-step log gains a line: wall time, on-CPU time of all their
    threads, and the time each main thread sat runnable waiting for a core that another process
    held. On a shared machine wall time swings with other people's load; CPU time per step hardly
    does, and wall minus the main threads' run-queue wait estimates the step on a machine of our
    own (waiting for a peer rank or for communication stays in it). Linux only; silent elsewhere."""

    def __init__(self, root_pid: int, lines_path: Path, marker: str, workers: int):
        self.root_pid, self.lines_path, self.marker, self.workers = root_pid, Path(lines_path), marker, workers
        self.first_seen: dict[int, tuple[float, int, float]] = {}  # lines -> (wall s, CPU ns, mean queued ns)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _workers(self) -> list[int]:
        tree = process_tree(self.root_pid)
        return [p for p in tree if self.marker in (c := cmdline(p)) and "torch.distributed.run" not in c]

    def _loop(self) -> None:
        pids: list[int] = []
        last_size = -1
        while not self._stop.is_set():
            try:
                if len(pids) < self.workers:
                    pids = self._workers()
                size = self.lines_path.stat().st_size if self.lines_path.exists() else 0
                if size and size != last_size and len(pids) == self.workers:
                    now = time.perf_counter()
                    stats = [sched_ns(p) for p in pids]
                    lines = self.lines_path.read_bytes().count(b"\n")
                    self.first_seen.setdefault(
                        lines, (now, sum(c for c, _ in stats), statistics.median([q for _, q in stats]))
                    )
                    last_size = size
            except (OSError, ValueError):
                if pids and not all(os.path.exists(f"/proc/{p}") for p in pids):
                    return  # a worker has exited: the run is over
            time.sleep(0.003)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def per_step(self, first: int, last: int) -> dict | None:
        """Means per step over steps ``first+1 .. last``: wall seconds, on-CPU seconds (all workers),
        run-queue seconds (main threads, median over workers), and wall minus that."""
        if first not in self.first_seen or last not in self.first_seen or last <= first:
            return None
        (w0, c0, q0), (w1, c1, q1) = self.first_seen[first], self.first_seen[last]
        n = last - first
        wall, queued = (w1 - w0) / n, (q1 - q0) / 1e9 / n
        return {"wall_s": wall, "cpu_s": (c1 - c0) / 1e9 / n, "queued_s": queued, "own_machine_s": wall - queued}


# --------------------------------------------------------------------------------------------
# output


def work_dir(workdir: Path | None, prefix: str) -> Path:
    """A new scratch folder for one bench run, under ``workdir`` (``--workdir``; made if missing)
    or the system's temporary folder."""
    if workdir:
        workdir.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=prefix, dir=workdir))


def median(xs):
    xs = list(xs)
    return statistics.median(xs) if xs else float("nan")


def loadavg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def verdict(met: bool | None) -> str:
    """A goal's cell in a result table: ``met``, ``MISSED``, or ``-`` for a row without a goal."""
    return "-" if met is None else ("met" if met else "MISSED")


def _figure(cell: str) -> bool:
    """Whether a table cell is a number (``1,024``, ``+3.5``, ``0.97x``, ``12%``), ``-`` or empty."""
    try:
        float(cell.rstrip("x%").replace(",", ""))
        return True
    except ValueError:
        return cell in ("-", "")


def print_table(headers: list[str], rows: list[list[str]]) -> None:
    """A boxed table of string cells: columns of figures right-aligned, the others left-aligned."""
    widths = [max(len(r[i]) for r in [headers, *rows]) for i in range(len(headers))]
    right = [bool(rows) and all(_figure(r[i]) for r in rows) for i in range(len(headers))]
    line = "+-" + "-+-".join("-" * w for w in widths) + "-+"

    def cells(r: list[str]) -> str:
        return "| " + " | ".join(s.rjust(w) if rj else s.ljust(w) for s, w, rj in zip(r, widths, right)) + " |"

    print("\n".join([line, cells(headers), line, *(cells(r) for r in rows), line]))


def write_results(path: str | Path, results: dict) -> Path:
    """Write ``results`` as JSON to ``path`` (a bare file name goes to ``RESULTS``), make its
    folder if needed, say where, and return the path."""
    path = Path(path)
    if not path.is_absolute() and path.parent == Path("."):
        path = RESULTS / path
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1, default=str))
    print(f"results written to {path}", flush=True)
    return path
