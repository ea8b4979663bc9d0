"""Checkpoints that never lose work: kill -9 mid-run and resume bit-exactly (asynchronous save),
and resume a tp2×pp2 checkpoint on other topologies."""

import pytest
import torch
from safetensors.torch import load_file

from neuron_parallel.checkpoint import export_checkpoint, is_complete, list_checkpoints
from neuron_parallel.testing.ranks import run_ranks

from ..conftest import ROOT, copy_as_a_crash_leaves_it, kill_9_once, read_metrics, torchrun, write_job
from ..unit.test_reporting import tensorboard_scalars


def test_kill_9_after_checkpoint_10_then_resume_is_bit_identical(tiny_world, tiny_dataset, tmp_path):
    train = dict(max_steps=20, save_every=5, keep_checkpoints=2, micro_batch_size=4, lr=2e-3, warmup_steps=2)
    ref_job = write_job(tmp_path / "ref", tiny_world["model"], tiny_dataset.path, world=2, train=train)
    job = write_job(
        tmp_path / "run", tiny_world["model"], tiny_dataset.path, world=2, train=dict(train, async_save=True)
    )
    kill = kill_9_once(tmp_path / "run/checkpoint-10/COMPLETE")  # a node dying: torchrun and every rank
    killed = run_ranks("neuron_parallel.train", 2, [str(job)], cwd=ROOT, on_start=kill)
    assert killed.returncode != 0, killed.tail()
    done = [c for c in list_checkpoints(tmp_path / "run") if is_complete(c)]
    assert done and done[-1].name != "checkpoint-20"

    resumed = torchrun(job, 2)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert f'"event": "resumed", "step": {int(done[-1].name.split("-")[1])}' in resumed.stdout
    assert torchrun(ref_job, 2).returncode == 0
    ours, ref = read_metrics(tmp_path / "run"), read_metrics(tmp_path / "ref")
    assert [m["step"] for m in ours] == list(range(1, 21))
    assert [m["loss"] for m in ours[10:]] == [m["loss"] for m in ref[10:]]
    # Steps the killed run logged past its checkpoint are purged: one loss per step, as in metrics.jsonl.
    losses = tensorboard_scalars(tmp_path / "run", "train/loss")
    assert losses == {m["step"]: [pytest.approx(m["loss"], rel=1e-6)] for m in ours}
    a = load_file(export_checkpoint(tmp_path / "run", tmp_path / "a") / "model.safetensors")
    b = load_file(export_checkpoint(tmp_path / "ref", tmp_path / "b") / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [c.name for c in list_checkpoints(tmp_path / "run")] == ["checkpoint-15", "checkpoint-20"]


@pytest.mark.slow
def test_tp2_pp2_checkpoint_resumes_on_other_topologies(tiny_world, tiny_dataset, tmp_path):
    base = dict(max_steps=6, save_every=3, keep_checkpoints=0, lr=3e-3, warmup_steps=1, seed=4)
    layout = dict(tp=2, pp=2, sequence_parallel=True, num_microbatches=4)
    model, data = tiny_world["model"], tiny_dataset.path
    ref = write_job(tmp_path / "ref", model, data, world=4, parallel=layout, train=dict(base, micro_batch_size=8))
    assert torchrun(ref, 4).returncode == 0
    assert [c.name for c in list_checkpoints(tmp_path / "ref")] == ["checkpoint-3", "checkpoint-6"]
    # The crash itself: test_train's and the kill -9 tests.
    expected = read_metrics(tmp_path / "ref")
    for name, world, parallel, mbs in (("tp1pp1", 1, {}, 8), ("dp4", 4, dict(zero_1=True), 2)):
        run = copy_as_a_crash_leaves_it(tmp_path / "ref", tmp_path / name)
        job = write_job(run, model, data, world=world, parallel=parallel, train=dict(base, micro_batch_size=mbs))
        proc = torchrun(job, world)
        assert proc.returncode == 0, proc.stderr[-4000:]
        assert '"event": "resumed", "step": 3' in proc.stdout
        got = read_metrics(run)
        assert [m["step"] for m in got] == list(range(1, 7))
        for a, b in zip(got[3:], expected[3:]):
            assert abs(a["loss"] - b["loss"]) <= 1e-5 * b["loss"], (name, a["step"], a["loss"], b["loss"])
