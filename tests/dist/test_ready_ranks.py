"""Ranks started ahead of their job (``neuron_parallel.launch.start_ready_ranks``, what
`neuron-flows run` does while its server starts): the next launch with the same settings hands
them its job and they train it exactly as freshly started ranks do; a launch with other settings
ends them and starts its own; ending them unused leaves no process and no file behind."""

from __future__ import annotations

import time

import pytest

from neuron_parallel import launch
from neuron_parallel.config import JobConfig, LaunchConfig
from neuron_parallel.procs import alive, process_tree

from ..conftest import read_metrics, write_job

TRAIN = dict(max_steps=3, save_every=0, lr=2e-3, warmup_steps=1, seed=1, micro_batch_size=4)


def _job(tmp_path, name, tiny_world, tiny_dataset) -> JobConfig:
    run = tmp_path / name
    return JobConfig.load(write_job(run, tiny_world["model"], tiny_dataset.path, world=2, train=TRAIN))


def _waiting_ranks(ready: launch.ReadyRanks, timeout_s: float = 120.0) -> list[int]:
    """The pids of the ranks under the ready torchrun, once both run."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ranks = [p for p in process_tree(ready.proc.pid) if p != ready.proc.pid and alive(p)]
        if len(ranks) >= 2:
            return ranks
        assert ready.proc.poll() is None, ready.proc.stdout.read()
        time.sleep(0.1)
    raise AssertionError("the ranks started ahead never ran")


def test_ranks_started_ahead_train_the_job_they_are_given_as_fresh_ranks_do(tiny_world, tiny_dataset, tmp_path):
    settings = LaunchConfig(nproc_per_node=2)
    ready = launch.start_ready_ranks(settings)
    ranks = _waiting_ranks(ready)
    time.sleep(1.0)  # the ranks are waiting for a job, not failing for want of one
    assert ready.proc.poll() is None and all(alive(p) for p in ranks)

    ahead, events = _job(tmp_path, "ahead", tiny_world, tiny_dataset), []
    result = launch.run_torchrun(ahead, settings, on_event=events.append)
    assert ready.proc.returncode == 0  # the torchrun started ahead ran this job
    assert not ready.dir.exists() and launch._ready is None
    assert result.final_step == 3 and [e["step"] for e in events if e["event"] == "step"] == [1, 2, 3]

    fresh = _job(tmp_path, "fresh", tiny_world, tiny_dataset)
    launch.run_torchrun(fresh, settings)
    losses = [[r["loss"] for r in read_metrics(job.output_dir) if "loss" in r] for job in (ahead, fresh)]
    assert len(losses[0]) == 3 and losses[0] == losses[1]


@pytest.mark.slow
def test_a_launch_with_other_settings_ends_the_ready_ranks_and_starts_its_own(tiny_world, tiny_dataset, tmp_path):
    ready = launch.start_ready_ranks(LaunchConfig(nproc_per_node=1))
    events: list[dict] = []
    launch.run_torchrun(
        _job(tmp_path, "other", tiny_world, tiny_dataset), LaunchConfig(nproc_per_node=2), on_event=events.append
    )
    assert ready.proc.returncode != 0 and not ready.dir.exists()  # ended unused
    assert next(e for e in events if e["event"] == "start")["world_size"] == 2


def test_ready_ranks_ended_unused_leave_nothing_behind():
    ready = launch.start_ready_ranks(LaunchConfig(nproc_per_node=2))
    tree = [ready.proc.pid, *_waiting_ranks(ready)]
    ready.close()
    assert not any(alive(p) for p in tree) and not ready.dir.exists() and launch._ready is None
    assert launch.start_ready_ranks(LaunchConfig(nproc_per_node=2, nnodes=2, rdzv_endpoint="localhost:1")) is None
