"""Ending the command ends the job: `neuron-flows train` and `neuron-flows run` terminated by
SIGTERM, SIGINT or SIGHUP while two ranks train, with their output going to a pipe, leave no
process behind for more than a few seconds; so does `run` ended while it starts, its temporary
server starting and its ranks, started ahead, waiting for their job.

Each case prints one ``FAULT`` line: seconds from the signal to the last process of the tree
gone, and how many were left after that bound."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from neuron_parallel.procs import alive, process_tree

from ..conftest import ROOT

BOUND_S = 15.0
"""No process of the job may outlive the signal by more: torchrun forwards SIGTERM to its ranks
at once; the launcher's SIGKILL follows after its 10 s grace."""


def _ranks(tree: list[int]) -> list[int]:
    found = []
    for pid in tree:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"neuron_parallel.train" in cmd and b"torch.distributed.run" not in cmd:
            found.append(pid)
    return found


def _training(run_dir: Path, tree: list[int]) -> bool:
    """Mid-training: the first step's record is on disk."""
    metrics = run_dir / "metrics.jsonl"
    return metrics.is_file() and bool(metrics.read_text().strip())


def _starting(run_dir: Path, tree: list[int]) -> bool:
    """Before the train step: both ranks run (importing, or waiting for their job), none trains."""
    return len(_ranks(tree)) == 2 and not (run_dir / "job.json").exists()


@pytest.mark.parametrize(
    ("command", "signum", "when"),
    [
        ("train", signal.SIGTERM, _training),
        # SIGHUP and SIGINT unwind through the same handler as SIGTERM: the slow tier (CI) runs them.
        pytest.param("train", signal.SIGHUP, _training, marks=pytest.mark.slow),
        pytest.param("run", signal.SIGINT, _training, marks=pytest.mark.slow),
        ("run", signal.SIGTERM, _starting),
    ],
    ids=["train-SIGTERM", "train-SIGHUP", "run-SIGINT", "run-SIGTERM-starting"],
)
def test_ending_the_command_ends_every_rank(tiny_world, tmp_path, command, signum, when):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "neuron_flows.flows.cli", command, str(ROOT / "configs/tiny-llama-cpu.yaml")]
    for kv in (
        f"model.name_or_path={tiny_world['model']}",
        f"data.source={tiny_world['corpus']}",
        f"data.cache_dir={tmp_path / 'datasets'}",
        "data.block_size=32",
        "train.max_steps=100000",
        "train.save_every=0",
        "train.log_every=1",
        f"output.dir={run_dir}",
        "launch.nproc_per_node=2",
        "hub.repo_id=null",
    ):
        cmd += ["--set", kv]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PREFECT_HOME": str(tmp_path / "prefect")}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    try:
        deadline = time.monotonic() + 240
        while not when(run_dir, tree := process_tree(proc.pid)):
            assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
            assert time.monotonic() < deadline, f"the command never reached {when.__name__}"
            time.sleep(0.1)
        tree = process_tree(proc.pid)
        assert len(_ranks(tree)) == 2, tree
        t0 = time.monotonic()
        proc.send_signal(signum)
        output = proc.communicate(timeout=60)[0].decode()
        while any(alive(p) for p in tree) and time.monotonic() - t0 < BOUND_S:
            time.sleep(0.1)
        seconds = time.monotonic() - t0
        left = [p for p in tree if alive(p)]
    finally:
        for pid in process_tree(proc.pid) if proc.poll() is None else []:
            os.kill(pid, signal.SIGKILL)
    print(
        f"FAULT 9 {command} {signal.Signals(signum).name} {when.__name__.strip('_')}: "
        f"job ended {seconds:.1f} s after the signal, {len(left)} orphan processes, exit code {proc.returncode}"
    )
    assert not left, f"processes outlived the command: {left}"
    assert proc.returncode == 128 + signum, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
