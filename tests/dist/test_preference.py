"""Preference tuning through the training entry point (torchrun): DPO starts at ln 2 (the policy
is its reference), learns the generated preference, and every layout gives one process's losses
and rewards (<= 1e-5 relative): DPO with LoRA (reference = adapters off) at tp2 + SP, DPO fully
fine-tuned (reference = the reference step's log-probabilities) at dp2 + ZeRO-1, SimPO and ORPO
at dp2. Rows pack several pairs each, so only a mean over the global batch's pairs agrees."""

import math

import pytest

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


def _run(run_dir, rows, model, *, world=1, parallel=None, mbs=4, gbs=8, reference=None, **train):
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
    proc = torchrun(run_dir / "job.json", world, timeout=400)
    assert proc.returncode == 0, proc.tail()
    return read_metrics(run_dir)


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


LAYOUTS = {  # name: (objective, ranks, parallel, micro batch, train extras, reference)
    "dpo-lora-tp2-sp": ("dpo", 2, dict(tp=2, sequence_parallel=True), 4, {"lora": LORA}, False),
    "dpo-full-dp2-zero1": ("dpo", 2, dict(zero_1=True), 2, {}, True),
    "simpo-dp2": ("simpo", 2, {}, 2, {"preference": {"beta": 2.0, "gamma": 0.5}}, False),
    "orpo-tp2": ("orpo", 2, dict(tp=2), 4, {}, False),
}


SLOW = {"simpo-dp2", "orpo-tp2"}  # the fast tier keeps DPO's two references; CI runs every objective


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in LAYOUTS])
def test_preference_matches_one_process(name, tiny_world, pref_rows, reference_dir, tmp_path):
    objective, world, parallel, mbs, extra, needs_ref = LAYOUTS[name]
    ref = reference_dir if needs_ref else None
    one = _run(tmp_path / "one", pref_rows, tiny_world["model"], objective=objective, mbs=2, reference=ref, **extra)
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
