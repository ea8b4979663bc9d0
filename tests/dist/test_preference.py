"""Preference tuning through the training entry point (torchrun): DPO starts at ln 2 (the policy
is its reference), learns the generated preference, and every layout gives one process's losses
and rewards (<= 1e-5 relative): DPO with LoRA (reference = adapters off) at tp2 + SP and at pp2
(1F1B: the reference a forward-only pipeline pass of its own), DPO fully fine-tuned (reference =
the reference step's log-probabilities) at dp2 + ZeRO-1 and at pp2 (zero-bubble V), SimPO at dp2
and ORPO at tp2. Rows pack several pairs each, so only a mean over the global batch's pairs
agrees. A fully fine-tuned DPO run killed with SIGKILL mid-run resumes bit-identically."""

import math
from pathlib import Path

import pytest
import torch

from ..conftest import read_metrics, torchrun

BLOCK = 96
STEPS = 3
TRAIN = dict(max_steps=STEPS, save_every=0, keep_checkpoints=1, lr=3e-3, warmup_steps=0, seed=2, eval_every=STEPS)
LORA = {"r": 4, "alpha": 8.0}
PAIR_METRICS = ("loss", "rewards_chosen", "rewards_rejected", "rewards_margin", "logps_chosen", "logps_rejected")


@pytest.fixture(scope="module")
def pref_rows(tiny_world, tmp_path_factory):
    from neuron_parallel.config import DataConfig
    from neuron_parallel.data import tokenize_data

    data = DataConfig(
        source=tiny_world["preference"],
        format="preference",
        block_size=BLOCK,
        eval_fraction=0.1,
        cache_dir=str(tmp_path_factory.mktemp("pref")),
    )
    return tokenize_data(data, tiny_world["model"])


@pytest.fixture(scope="module")
def reference_dir(tiny_world, pref_rows):
    from neuron_parallel.preference import compute_reference

    return str(compute_reference(tiny_world["model"], pref_rows.path, pref_rows.eval_path))


def _run(run_dir, rows, model, *, world=1, **layout):
    job = _job(run_dir, rows, model, world=world, **layout)
    proc = torchrun(job, world, timeout=400)
    assert proc.returncode == 0, proc.tail()
    return read_metrics(run_dir)


def _job(run_dir, rows, model, *, world=1, parallel=None, mbs=4, gbs=8, reference=None, **train):
    """The job.json of a run on ``world`` ranks (dp the rest of ``parallel``) of ``rows``."""
    from neuron_parallel.checkpoint.output import claim_run_dir
    from neuron_parallel.config import DataConfig, JobConfig, ParallelConfig, TrainConfig

    job = JobConfig(
        model_path=model,
        dataset_path=rows.path,
        eval_dataset_path=rows.eval_path,
        reference_path=reference,
        output_dir=str(run_dir),
        data=DataConfig(block_size=BLOCK, format="preference"),
        parallel=ParallelConfig.for_world(world, **(parallel or {})),
        train=TrainConfig(**{**TRAIN, "global_batch_size": gbs, "micro_batch_size": mbs, **train}),
    )
    claim_run_dir(run_dir)
    (run_dir / "job.json").write_text(job.to_json())
    return run_dir / "job.json"


def test_rows_pack_several_pairs(pref_rows):
    from datasets import load_from_disk

    from neuron_parallel.preference import pairs_per_row

    seq = load_from_disk(pref_rows.path).with_format("numpy")[:]["sequence_ids"]
    assert pairs_per_row(seq).max() >= 2 and len(set(pairs_per_row(seq).tolist())) > 1


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_dpo_starts_at_ln2_with_zero_rewards(mode, tiny_world, pref_rows, reference_dir, tmp_path):
    extra = {"lora": LORA} if mode == "lora" else {"reference": reference_dir}
    first = _run(tmp_path, pref_rows, tiny_world["model"], objective="dpo", max_steps=1, eval_every=0, **extra)[0]
    assert abs(first["loss"] - math.log(2)) < 1e-6, first
    assert abs(first["rewards_chosen"]) < 1e-6 and abs(first["rewards_margin"]) < 1e-6
    assert first["pairs"] > 8  # rows hold several pairs: global_batch_size counts rows


def test_dpo_learns_the_generated_preference(tiny_world, pref_rows, tmp_path):
    rows = _run(
        tmp_path, pref_rows, tiny_world["model"], objective="dpo", lora=LORA, max_steps=30, lr=2e-2, eval_every=30
    )
    assert rows[-1]["rewards_accuracy"] >= 0.9 and rows[-1]["loss"] < rows[0]["loss"]
    assert rows[-1]["eval_rewards_accuracy"] >= 0.9 and rows[-1]["eval_loss"] < math.log(2)


def _trained(row: dict) -> dict:
    """A metrics row without what measures the machine rather than the training (times, rates, memory)."""
    return {k: v for k, v in row.items() if not (k.endswith("_s") or "peak_memory" in k)}


@pytest.mark.slow  # a second run of the kill -9 path (tests/dist/test_resume.py), under DPO
def test_dpo_killed_mid_run_resumes_bit_identically(tiny_world, pref_rows, reference_dir, tmp_path):
    """DPO fully fine-tuned at dp2 + ZeRO-1 on the reference step's values, asynchronous saves:
    torchrun and both ranks killed (SIGKILL) once checkpoint 4 of 12 is complete, then the same
    job again resumes and ends where the uninterrupted run ends: every step's loss, rewards and
    eval figures, and the final weights, bit for bit. The reference folder is read, never
    rewritten."""
    from safetensors.torch import load_file

    from neuron_parallel.checkpoint import export_checkpoint, is_complete, list_checkpoints
    from neuron_parallel.testing.ranks import run_ranks

    from ..conftest import ROOT, kill_9_once

    layout = dict(world=2, parallel=dict(zero_1=True), mbs=2, reference=reference_dir, objective="dpo")
    train = dict(max_steps=12, save_every=4, keep_checkpoints=2, eval_every=4, log_every=1, async_save=True)
    reference = {p: p.read_bytes() for p in sorted(Path(reference_dir).rglob("*")) if p.is_file()}
    job = _job(tmp_path / "run", pref_rows, tiny_world["model"], **layout, **train)
    kill = kill_9_once(tmp_path / "run" / "checkpoint-4" / "COMPLETE")
    killed = run_ranks("neuron_parallel.train", 2, [str(job)], cwd=ROOT, on_start=kill)
    assert killed.returncode != 0, killed.tail()
    done = [c for c in list_checkpoints(tmp_path / "run") if is_complete(c)]
    assert done and done[-1].name != "checkpoint-12"
    resumed = torchrun(job, 2, timeout=400)
    assert resumed.returncode == 0, resumed.tail()
    assert f'"event": "resumed", "step": {int(done[-1].name.split("-")[1])}' in resumed.stdout
    expected = _run(tmp_path / "ref", pref_rows, tiny_world["model"], **layout, **train)

    ours = read_metrics(tmp_path / "run")
    assert [m["step"] for m in ours] == list(range(1, 13)) and "eval_rewards_accuracy" in ours[-1]
    assert {"loss", "grad_norm", "rewards_margin", "logps_chosen"} <= set(_trained(ours[0]))
    for a, b in zip(ours, expected):
        assert _trained(a) == _trained(b), a["step"]
    wa = load_file(export_checkpoint(tmp_path / "run", tmp_path / "a") / "model.safetensors")
    wb = load_file(export_checkpoint(tmp_path / "ref", tmp_path / "b") / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert not all(torch.equal(wa[k], w) for k, w in load_file(Path(tiny_world["model"]) / "model.safetensors").items())
    assert {p: p.read_bytes() for p in sorted(Path(reference_dir).rglob("*")) if p.is_file()} == reference


LAYOUTS = {  # name: (objective, ranks, parallel, micro batch, train extras, reference)
    "dpo-lora-tp2-sp": ("dpo", 2, dict(tp=2, sequence_parallel=True), 4, {"lora": LORA}, False),
    "dpo-full-dp2-zero1": ("dpo", 2, dict(zero_1=True), 2, {}, True),
    "simpo-dp2": ("simpo", 2, {}, 2, {"preference": {"beta": 2.0, "gamma": 0.5}}, False),
    "orpo-tp2": ("orpo", 2, dict(tp=2), 4, {}, False),
    # Context parallelism: each completion's log-probabilities summed over the two shards of its
    # row (pairs cross the shard boundaries), for the policy and the reference with adapters off.
    "dpo-lora-cp2": ("dpo", 2, dict(cp=2), 4, {"lora": LORA}, False),
    # The same sums on the last pipeline stage, in the training pass and in the reference pass.
    "dpo-lora-cp2-pp2": ("dpo", 4, dict(cp=2, pp=2, num_microbatches=2), 4, {"lora": LORA}, False),
    # The reference pass through both stages with the adapters off, then the training pass; two
    # micro-batches of two pipeline microbatches each.
    "dpo-lora-pp2": ("dpo", 2, dict(pp=2, num_microbatches=2), 4, {"lora": LORA}, False),
    # The reference step's values reach the last stage, rank 0 under zbv's V placement.
    "dpo-full-pp2-zbv": (
        "dpo",
        2,
        dict(pp=2, pipeline_schedule="zbv", virtual_stages=2, num_microbatches=4),
        8,
        {},
        True,
    ),
}


# The fast tier keeps DPO's two references and a pipeline; CI runs every objective and layout.
SLOW = {"simpo-dp2", "orpo-tp2", "dpo-full-pp2-zbv", "dpo-lora-cp2-pp2"}


@pytest.fixture(scope="module")
def one_process(tiny_world, pref_rows, reference_dir, tmp_path_factory):
    """The one-process run of a layout's objective, training extras and reference, run once for
    every layout that shares them (micro-batches of 2 rows)."""
    runs: dict[str, list[dict]] = {}

    def run(objective: str, extra: dict, needs_ref: bool) -> list[dict]:
        key = repr((objective, extra, needs_ref))
        if key not in runs:
            ref = reference_dir if needs_ref else None
            where = tmp_path_factory.mktemp("one")
            runs[key] = _run(where, pref_rows, tiny_world["model"], objective=objective, mbs=2, reference=ref, **extra)
        return runs[key]

    return run


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in LAYOUTS])
def test_preference_matches_one_process(name, tiny_world, pref_rows, reference_dir, one_process, tmp_path):
    objective, world, parallel, mbs, extra, needs_ref = LAYOUTS[name]
    ref = reference_dir if needs_ref else None
    one = one_process(objective, extra, needs_ref)
    ours = _run(
        tmp_path / "ours",
        pref_rows,
        tiny_world["model"],
        world=world,
        parallel=parallel,
        mbs=mbs,
        objective=objective,
        reference=ref,
        **extra,
    )
    assert [m["step"] for m in ours] == list(range(1, STEPS + 1))
    for a, b in zip(ours, one):
        assert a["pairs"] == b["pairs"]
        for key in PAIR_METRICS + (("eval_loss", "eval_rewards_margin") if "eval_loss" in b else ()):
            # A DPO reward is β (π − ref), a difference of two sums of log-probabilities in fp32:
            # its error is relative to β |π|, not to itself, while the two are still close.
            scale = max(abs(b[key]), 0.1 * abs(b["logps_rejected"]) if "rewards" in key else 0.0)
            assert abs(a[key] - b[key]) <= 1e-5 * scale, (a["step"], key, a[key], b[key])
        assert a["rewards_accuracy"] == b["rewards_accuracy"]
