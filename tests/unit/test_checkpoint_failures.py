"""A checkpoint write that fails stops training with a message that says what happened and what
to do, and never touches the checkpoint before it; ``launch.timeout_s`` is validated and reaches
the ranks. One process, no process group: the writer degenerates to a world of one."""

from __future__ import annotations

import errno
import json
import math
from pathlib import Path

import pytest
import torch

import neuron_parallel.checkpoint.save as save_module
from neuron_parallel.checkpoint import is_complete, list_checkpoints
from neuron_parallel.checkpoint.output import OWNER_FILE, claim_output_dir
from neuron_parallel.checkpoint.save import CheckpointSaveFailed, CheckpointWriter
from neuron_parallel.config import JobConfig, LaunchConfig

COORDS = {"tp_rank": 0, "pp_rank": 0, "dp_rank": 0}


@pytest.fixture
def model_dir(tmp_path) -> Path:
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (path / "tokenizer.json").write_text("{}")
    return path


def _save(writer: CheckpointWriter, step: int) -> Path:
    return writer.save(
        step,
        model={"w": torch.full((4, 4), float(step))},
        optim={"w.exp_avg": torch.zeros(4, 4)},
        parallel={"tp": 1, "pp": 1, "dp": 1},
        trainer_state={"step": step},
    )


def _disk_full(tensors, path, metadata=None):
    raise OSError(errno.ENOSPC, "No space left on device", path)


@pytest.mark.parametrize("async_save", [True, False])
def test_a_failed_write_stops_with_the_cause_and_the_fix(tmp_path, model_dir, monkeypatch, async_save):
    run = tmp_path / "run"
    writer = CheckpointWriter(run, coords=COORDS, model_dir=model_dir, async_save=async_save)
    _save(writer, 1)
    writer.wait()
    before = {p.name: p.read_bytes() for p in (run / "checkpoint-1").rglob("*") if p.is_file()}
    monkeypatch.setattr(save_module, "save_file", _disk_full)
    with pytest.raises(CheckpointSaveFailed) as failed:
        _save(writer, 2)
        writer.wait()
    message = str(failed.value)
    assert "checkpoint-2 could not be saved" in message and "No space left on device" in message
    assert "free disk space" in message and "resumes from checkpoint-1, which is intact" in message
    assert [c.name for c in list_checkpoints(run) if is_complete(c)] == ["checkpoint-1"]
    assert (run / "checkpoint-2.tmp").is_dir() and not (run / "checkpoint-2").exists()
    assert {p.name: p.read_bytes() for p in (run / "checkpoint-1").rglob("*") if p.is_file()} == before
    writer.check()  # the failure was reported once; nothing is in flight any more


def test_check_reports_a_background_failure_without_blocking(tmp_path, model_dir, monkeypatch):
    writer = CheckpointWriter(tmp_path / "run", coords=COORDS, model_dir=model_dir, async_save=True)
    monkeypatch.setattr(save_module, "save_file", _disk_full)
    _save(writer, 3)
    writer._thread.join()
    with pytest.raises(CheckpointSaveFailed, match="no earlier checkpoint is complete, so it starts again from step 0"):
        writer.check()


def test_partial_folders_of_a_crashed_save_are_removed(tmp_path, model_dir):
    run = claim_output_dir(tmp_path / "run")  # a run directory neuron-flows created
    (run / "checkpoint-7.tmp" / "shards").mkdir(parents=True)
    (run / "checkpoint-7").mkdir()  # incomplete, but not ours to delete: resume skips it with a warning
    (run / "notes.tmp").mkdir()
    writer = CheckpointWriter(run, coords=COORDS, model_dir=model_dir)
    assert writer.remove_partial() == ["checkpoint-7.tmp"]
    assert sorted(p.name for p in run.iterdir() if p.name != OWNER_FILE) == ["checkpoint-7", "notes.tmp"]


@pytest.mark.parametrize("value", [0, -5, math.nan])
def test_launch_timeout_must_be_positive(value):
    with pytest.raises(ValueError, match=r"launch.timeout_s must be > 0.*e\.g\. 1800"):
        LaunchConfig(timeout_s=value)


def test_launch_timeout_reaches_the_ranks_through_job_json():
    job = JobConfig(model_path="m", dataset_path="d", output_dir="o", launch=LaunchConfig(timeout_s=15))
    assert JobConfig.from_dict(json.loads(job.to_json())).launch.timeout_s == 15
    assert LaunchConfig().timeout_s == 1800
