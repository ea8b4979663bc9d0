"""LoRA trains like one process on every layout, leaves the base model untouched, and resumes.

Each case runs ``run_training`` (the real entry point's loop) under torchrun for 5 steps with
the same global batch as a single-process reference; every step's loss must agree within 1e-5
relative and the adapters of the final checkpoint within 1e-5 of each tensor's largest value,
while every frozen base parameter on every rank stays bit-identical to the base model's weights
(``dist_lora_check.py``). The parity cases use SGD, whose update is linear in the gradient:
AdamW divides by the root of the second moment, so for A (whose gradient is exactly zero at step
1, while B is zero, and tiny after) a reduction-order rounding becomes a sign-sized update
(measured: 2e-4 of the largest entry after 5 steps). The resume cases use AdamW.
"""

import os
import signal
import time

import pytest
import torch

from neuron_parallel.checkpoint import CheckpointTensors, is_complete, list_checkpoints
from neuron_parallel.procs import process_tree
from neuron_parallel.testing.ranks import run_ranks

from ..conftest import ROOT, copy_as_a_crash_leaves_it, max_rel_diff, read_metrics, torchrun, write_job
from .dist_lora_check import HOOK

LORA = dict(r=4, alpha=8.0)
TRAIN = dict(max_steps=5, save_every=0, keep_checkpoints=1, lr=1e-2, warmup_steps=1, seed=3, lora=LORA)
GLOBAL_BATCH = 8
LAYOUTS = {
    "dp2-zero1": (2, dict(zero_1=True)),
    "tp2-sp": (2, dict(tp=2, sequence_parallel=True)),
    "pp2": (2, dict(pp=2, num_microbatches=2)),
}
"""LoRA at 8 ranks (dp2 × tp2 + SP × pp2, ZeRO-1) is ``test_sft_parity``'s combined case, on packed
chat rows with eval."""


def _run(run_dir, world, parallel, model, dataset):
    dp = world // parallel.get("tp", 1) // parallel.get("pp", 1)
    train = dict(TRAIN, optimizer="sgd", lr=0.5, global_batch_size=GLOBAL_BATCH, micro_batch_size=GLOBAL_BATCH // dp)
    job = write_job(run_dir, model, dataset, world=world, parallel=parallel, train=train)
    r = torchrun(job, world, hooks=[HOOK], timeout=400)
    assert r.returncode == 0, r.tail()
    assert sorted(x["rank"] for x in r.results) == list(range(world))
    for x in r.results:
        assert x["checked"] > 0 and x["changed"] == [], x  # the base is frozen, bit for bit
        assert x["all_adapters"] and x["trainable"] > 0, x
    return run_dir


def _adapters(run_dir) -> CheckpointTensors:
    return CheckpointTensors(list_checkpoints(run_dir)[-1])


@pytest.fixture(scope="module")
def reference(tiny_world, tiny_dataset, tmp_path_factory):
    return _run(tmp_path_factory.mktemp("lora-ref"), 1, {}, tiny_world["model"], tiny_dataset.path)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_lora_layout_matches_one_process(name, reference, tiny_world, tiny_dataset, tmp_path):
    world, parallel = LAYOUTS[name]
    run = _run(tmp_path, world, parallel, tiny_world["model"], tiny_dataset.path)
    ours, theirs = read_metrics(run), read_metrics(reference)
    assert [m["step"] for m in ours] == list(range(1, 6))
    for a, b in zip(ours, theirs):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (a["step"], a["loss"], b["loss"])
    mine, want = _adapters(run), _adapters(reference)
    names = sorted(want.names("model"))
    assert sorted(mine.names("model")) == names and all(n.endswith((".lora_A", ".lora_B")) for n in names)
    assert len(names) == 2 * 7 * 4  # 7 projections × 4 layers
    assert all(want.read(n).abs().max() > 0 for n in names)  # B has left its zero start
    rel = {n: max_rel_diff(mine.read(n), want.read(n)) for n in names}
    worst = max(rel, key=rel.get)
    assert rel[worst] <= 1e-5, (worst, rel[worst])
    assert mine.manifest.adapter["lora"]["r"] == 4 and mine.manifest.adapter["base_model"]["sha256"]


@pytest.mark.slow
def test_lora_kill_9_after_a_checkpoint_resumes_to_bit_identical_adapters(tiny_world, tiny_dataset, tmp_path):
    train = dict(TRAIN, max_steps=8, save_every=4, keep_checkpoints=2, micro_batch_size=4, async_save=True)
    model, data = tiny_world["model"], tiny_dataset.path
    ref = write_job(tmp_path / "ref", model, data, world=2, train=train)
    job = write_job(tmp_path / "run", model, data, world=2, train=train)

    def kill_after_checkpoint_4(proc):
        deadline = time.monotonic() + 240
        while not (tmp_path / "run/checkpoint-4/COMPLETE").exists():
            assert proc.poll() is None, "the run ended before checkpoint-4"
            assert time.monotonic() < deadline
            time.sleep(0.01)
        for pid in process_tree(proc.pid):
            os.kill(pid, signal.SIGKILL)

    killed = run_ranks("neuron_parallel.train", 2, [str(job)], cwd=ROOT, on_start=kill_after_checkpoint_4)
    assert killed.returncode != 0
    assert [c.name for c in list_checkpoints(tmp_path / "run") if is_complete(c)][-1] != "checkpoint-8"
    resumed = torchrun(job, 2)
    assert resumed.returncode == 0, resumed.tail()
    assert any(e["event"] == "resumed" for e in resumed.events), (resumed.events, resumed.stdout[-3000:])
    assert torchrun(ref, 2).returncode == 0
    assert [m["loss"] for m in read_metrics(tmp_path / "run")] == [m["loss"] for m in read_metrics(tmp_path / "ref")]
    a, b = _adapters(tmp_path / "run"), _adapters(tmp_path / "ref")
    assert a.manifest.step == b.manifest.step == 8
    for kind in ("model", "optim"):  # the adapters and their Adam state
        assert sorted(a.names(kind)) == sorted(b.names(kind)) and b.names(kind)
        assert all(torch.equal(a.read(n), b.read(n)) for n in b.names(kind))


@pytest.mark.slow
def test_a_tp2_lora_checkpoint_resumes_at_tp1(tiny_world, tiny_dataset, tmp_path):
    train = dict(TRAIN, max_steps=6, save_every=3, keep_checkpoints=0, global_batch_size=8, micro_batch_size=8)
    layout = dict(tp=2, sequence_parallel=True)
    model, data = tiny_world["model"], tiny_dataset.path
    ref = write_job(tmp_path / "ref", model, data, world=2, parallel=layout, train=train)
    assert torchrun(ref, 2).returncode == 0
    assert [c.name for c in list_checkpoints(tmp_path / "ref")] == ["checkpoint-3", "checkpoint-6"]
    run = copy_as_a_crash_leaves_it(tmp_path / "ref", tmp_path / "tp1")
    proc = torchrun(write_job(run, model, data, world=1, train=train), 1)
    assert proc.returncode == 0, proc.tail()
    assert [e["step"] for e in proc.events if e["event"] == "resumed"] == [3]
    for a, b in zip(read_metrics(run)[3:], read_metrics(tmp_path / "ref")[3:]):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * b["loss"], (a["step"], a["loss"], b["loss"])
