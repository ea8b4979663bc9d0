"""Warm ranks: one torchrun whose ranks import torch, transformers and the trainer once, join one
process group, and then train job after job, so that a suite of short training jobs pays
torchrun's start and every rank's imports once per world size instead of once per job.

A job runs exactly as under ``python -m neuron_parallel.train``: the same ``train_job`` on the
same process group, every rank seeded by the job. What a pool cannot give a job is its own
environment or its own process: a job that needs environment variables (failure injection), a
kill, or a failing exit is run by :func:`neuron_parallel.testing.ranks.run_ranks` instead. A job
that raises ends the pool (its rank prints the traceback and exits, torchrun ends the others);
the result says so and the next :meth:`RankPool.run` needs a new pool.

The harness side (:class:`RankPool`) hands job ``n`` to the ranks as the file ``<dir>/<n>.job``
(the job file's path and the job's checkpoint hooks, as JSON) and reads its result from rank 0's ``RESULT_PREFIX`` line
``{"pool_job": n}``, printed once every rank has finished the job.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

from ..procs import kill_tree
from .ranks import RESULT_PREFIX, RanksResult, print_rank_result, start_ranks, structured_lines

POLL_S = 0.02
"""How often an idle rank looks for its next job."""
STOP_FILE = "stop"
"""Written by :meth:`RankPool.close`: the ranks end at their next look."""


def _job_file(folder: Path, n: int) -> Path:
    return folder / f"{n:06d}.job"


class RankPool:
    """``nproc`` local ranks under one torchrun (standalone), training the jobs :meth:`run` hands
    them one at a time. Ends with :meth:`close`, or with this process (``die_with_parent``)."""

    def __init__(self, nproc: int, *, cwd: str | Path | None = None, threads: int = 1) -> None:
        self.nproc = nproc
        self.dir = Path(tempfile.mkdtemp(prefix=f"rank-pool-{nproc}-"))
        self.environ = dict(os.environ)
        """This process's environment when the ranks started: theirs (``start_ranks``)."""
        self.proc = start_ranks(__name__, nproc, [str(self.dir)], threads=threads, cwd=cwd)
        self._out: list[str] = []
        self._err: list[str] = []
        self._changed = threading.Condition()
        self._next = 0
        for stream, lines in ((self.proc.stdout, self._out), (self.proc.stderr, self._err)):
            threading.Thread(target=self._read, args=(stream, lines), daemon=True).start()

    def _read(self, stream, lines: list[str]) -> None:
        for line in stream:
            with self._changed:
                lines.append(line)
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    @property
    def jobs_run(self) -> int:
        """Jobs handed to the ranks so far. Each leaves the process groups of its mesh behind
        (gloo keeps a connection thread per group, which costs CPU even idle), so a caller may
        start a new pool after a number of them."""
        return self._next

    def _done(self, n: int, start: int) -> dict | None:
        for line in self._out[start:]:
            at = line.find(RESULT_PREFIX)
            if at >= 0:
                try:
                    result = json.loads(line[at + len(RESULT_PREFIX) :])
                except json.JSONDecodeError:
                    continue
                if result.get("pool_job") == n:
                    return result
        return None

    def run(
        self, job_path: str | Path, *, hooks: list[str] | tuple[str, ...] = (), timeout: float = 300
    ) -> RanksResult:
        """Train the job in ``job_path`` on the pool's ranks, with ``hooks`` (``"module:function"``
        names of ``train.CheckpointHook``s, imported by the ranks) after every checkpoint; what
        came back, as ``run_ranks`` returns it (return code 124 and the pool ended on a timeout;
        the pool's exit code when a rank failed)."""
        n, self._next = self._next, self._next + 1
        t0 = time.monotonic()
        with self._changed:
            out0, err0 = len(self._out), len(self._err)
        tmp = self.dir / f"{n:06d}.tmp"
        tmp.write_text(json.dumps({"job": str(Path(job_path).resolve()), "hooks": list(hooks)}))
        os.replace(tmp, _job_file(self.dir, n))
        deadline = t0 + timeout
        with self._changed:
            while (done := self._done(n, out0)) is None and self.alive and time.monotonic() < deadline:
                self._changed.wait(timeout=0.5)
        timed_out = done is None and self.alive
        if done is None:
            self.close()
        with self._changed:
            stdout, stderr = "".join(self._out[out0:]), "".join(self._err[err0:])
        events, results = structured_lines(stdout)
        return RanksResult(
            returncode=0 if done is not None else 124 if timed_out else (self.proc.returncode or 1),
            stdout=stdout,
            stderr=stderr,
            events=events,
            results=[r for r in results if "pool_job" not in r],
            timed_out=timed_out,
            seconds=time.monotonic() - t0,
        )

    def close(self) -> None:
        """End the ranks (they look for the stop file between jobs; torchrun's process tree is
        ended after a grace period) and remove the pool's folder."""
        (self.dir / STOP_FILE).touch()
        kill_tree(self.proc, grace_s=5.0)
        for path in self.dir.iterdir():
            path.unlink()
        self.dir.rmdir()


def _hook(name: str):
    """The function ``"module:function"`` names."""
    import importlib

    module, _, function = name.partition(":")
    return getattr(importlib.import_module(module), function)


def main(argv: list[str] | None = None) -> None:
    """A rank of a pool: wait for each job file in turn and train it (``train_job``), in the
    process group the first job's device and timeout start."""
    import torch
    import torch.distributed as dist

    from ..config import JobConfig
    from ..mesh import exit_rank, init_distributed
    from ..train import train_job

    folder = Path((argv or sys.argv[1:])[0])
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    parent, n = os.getppid(), 0
    while True:
        job_file = _job_file(folder, n)
        while not job_file.exists():
            if os.getppid() != parent or (folder / STOP_FILE).exists():
                exit_rank(0)
            time.sleep(POLL_S)
        request = json.loads(job_file.read_text())
        job = JobConfig.load(request["job"])
        init_distributed(job.device, timeout_s=job.launch.timeout_s)
        try:
            train_job(job, [_hook(name) for name in request["hooks"]])
            dist.barrier()
        except BaseException:
            import traceback

            traceback.print_exc()
            exit_rank(1)
        # The finished job's model and optimizer may sit in reference cycles until the collector
        # runs: collected now, so that the next job starts with this rank's memory as a fresh
        # rank's (its measured peak included).
        gc.collect()
        if dist.get_rank() == 0:
            print_rank_result({"pool_job": n})
        n += 1


if __name__ == "__main__":
    main()
