"""A rank killed with SIGKILL mid-step ends the job at once with no process left, and the retry
resumes from the newest checkpoint; a newest checkpoint whose shard is corrupted, truncated or
missing is passed over for the one before it, and training continues from there to the end.

Each fault prints one ``FAULT`` line with its figures."""

from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path

import pytest

from neuron_parallel.checkpoint import is_complete, list_checkpoints, validate_checkpoint
from neuron_parallel.checkpoint.resume import find_resume_checkpoint
from neuron_parallel.procs import alive, process_tree
from neuron_parallel.testing.ranks import run_ranks

from ..conftest import ROOT, read_metrics, torchrun, write_job

SAVE_EVERY = 5
STEPS = 16


def _rank_pid(tree: list[int], rank: int) -> int | None:
    for pid in tree:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"torch.distributed.run" not in cmd and f"RANK={rank}".encode() in env:
            return pid
    return None


def _step(run: Path) -> int:
    try:
        return max((m["step"] for m in read_metrics(run)), default=0)
    except (OSError, ValueError):
        return 0


@pytest.mark.slow
def test_a_rank_killed_mid_step_then_a_damaged_newest_checkpoint(tiny_world, tiny_dataset, tmp_path):
    train = dict(max_steps=STEPS, save_every=SAVE_EVERY, keep_checkpoints=0, micro_batch_size=4, lr=2e-3)
    run = tmp_path / "run"
    job = write_job(run, tiny_world["model"], tiny_dataset.path, world=2, train=train)
    seen: dict = {}

    def kill_rank_1_mid_step(proc):
        deadline = time.monotonic() + 240
        while not (run / f"checkpoint-{2 * SAVE_EVERY}" / "COMPLETE").exists() or _step(run) < 2 * SAVE_EVERY + 2:
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended before the fault"
            time.sleep(0.02)
        seen["tree"] = process_tree(proc.pid)
        seen["step"] = _step(run)
        pid = _rank_pid(seen["tree"], 1)
        assert pid is not None, seen["tree"]
        seen["t0"] = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        proc.wait()
        seen["detect_s"] = time.monotonic() - seen["t0"]

    killed = run_ranks("neuron_parallel.train", 2, [str(job)], cwd=ROOT, on_start=kill_rank_1_mid_step, timeout=300)
    assert killed.returncode != 0, killed.tail()
    time.sleep(1.0)
    orphans = [p for p in seen["tree"] if alive(p)]
    done = [c for c in list_checkpoints(run) if is_complete(c)]
    newest = int(done[-1].name.split("-")[1])
    lost = _step(run) - newest
    damaged = [c for c in done if validate_checkpoint(c)]
    print(
        f"FAULT 1 kill -9 of rank 1 at step {seen['step']}: job ended {seen['detect_s']:.1f} s later, "
        f"{len(orphans)} orphan processes, {lost} steps lost (checkpoint interval {SAVE_EVERY}), "
        f"{len(damaged)} damaged checkpoints"
    )
    assert not orphans and not damaged and 0 <= lost <= SAVE_EVERY
    assert seen["detect_s"] < 60

    # The retry of the run as the fault left it resumes from its newest checkpoint, which is intact.
    intact = tmp_path / "intact"
    shutil.copytree(run, intact)
    retried = torchrun(write_job(intact, tiny_world["model"], tiny_dataset.path, world=2, train=train), 2)
    assert retried.returncode == 0, retried.tail()
    assert f'"event": "resumed", "step": {newest}' in retried.stdout, retried.tail()
    assert [m["step"] for m in read_metrics(intact)] == list(range(1, STEPS + 1))
    print(f"FAULT 1 retry resumed from the newest checkpoint, step {newest}, and finished step {STEPS}")

    # The newest checkpoint damaged three ways: each time the one before it is chosen, with a
    # warning that names the problem; nothing is deleted.
    shard = Path("shards/tp_rank_00_pp_rank_00/model.safetensors")
    previous = done[-2]
    for damage in ("corrupted", "truncated", "missing"):
        copy = tmp_path / damage
        shutil.copytree(run, copy)
        path = copy / done[-1].name / shard
        if damage == "corrupted":
            data = bytearray(path.read_bytes())
            data[-3] ^= 0xFF
            path.write_bytes(bytes(data))
        elif damage == "truncated":
            path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
        else:
            path.unlink()
        chosen, skipped = find_resume_checkpoint(copy)
        why = skipped[0].rsplit(": ", 1)[-1][:120]
        print(f"FAULT 4 {damage} shard in {done[-1].name}: resume chooses {chosen.name}; {why}")
        assert chosen.name == previous.name and len(skipped) == 1 and done[-1].name in skipped[0]
        assert (copy / done[-1].name).is_dir()

    # The retry of the corrupted copy trains on from the checkpoint before and ends the run.
    resumed = torchrun(
        write_job(tmp_path / "corrupted", tiny_world["model"], tiny_dataset.path, world=2, train=train), 2
    )
    assert resumed.returncode == 0, resumed.tail()
    step = int(previous.name.split("-")[1])
    assert f'"event": "resumed", "step": {step}' in resumed.stdout
    assert [m["step"] for m in read_metrics(tmp_path / "corrupted")] == list(range(1, STEPS + 1))
    print(f"FAULT 4 retry resumed from step {step} and finished step {STEPS}; steps lost {newest - step}")
