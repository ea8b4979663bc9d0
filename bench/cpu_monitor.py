"""Per-step CPU accounting of benchmark workers from /proc/PID/task/*/schedstat: on-CPU time of
all their threads and the time their main threads waited for a core, so that load from other
processes on a shared machine can be told apart from the code's own cost."""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

from neuron_parallel.launch import process_tree


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _sched_ns(pid: int) -> tuple[int, int]:
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


class CpuMonitor:
    """Samples the scheduler statistics of a run's worker processes (the ranks, not torchrun's
    agent) each time the run's per-step log gains a line: wall time, on-CPU time of all their
    threads, and the time each main thread sat runnable waiting for a core that another process
    held. On a shared machine wall time swings with other people's load; CPU time per step hardly
    does, and wall minus the main threads' run-queue wait estimates the step on a machine of our
    own (waiting for a peer rank or for communication stays in it). Linux only; silent elsewhere."""

    def __init__(self, root_pid: int, lines_path: Path, marker: str, workers: int):
        import threading

        self.root_pid, self.lines_path, self.marker, self.workers = root_pid, Path(lines_path), marker, workers
        self.first_seen: dict[int, tuple[float, int, float]] = {}  # lines -> (wall s, CPU ns, mean queued ns)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        pids: list[int] = []
        last_size = -1
        while not self._stop.is_set():
            try:
                if len(pids) < self.workers:
                    pids = [
                        p
                        for p in process_tree(self.root_pid)
                        if self.marker in (c := _cmdline(p)) and "torch.distributed.run" not in c
                    ]
                size = self.lines_path.stat().st_size if self.lines_path.exists() else 0
                if size and size != last_size and len(pids) == self.workers:
                    now = time.perf_counter()
                    stats = [_sched_ns(p) for p in pids]
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
