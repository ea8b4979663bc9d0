"""Masked, packed chat SFT with an eval set trains like one process on every layout.

The rows come from the tokenize step itself (multi-turn chats rendered with the ChatML template,
loss on assistant turns only, packed by document), so rows hold different numbers of trained
tokens. The reference runs 4 micro-batches of 2 rows per step; the layouts run 2 of 2 or 4,
split again into pipeline microbatches: only a loss normalised over the labelled tokens of the
whole global batch gives the same number everywhere. Train loss of every step and eval loss
(every 2 steps) must agree within 1e-5 relative.

The 8-rank combination trains LoRA adapters (with SGD, as ``test_lora`` explains) against a LoRA
reference: one run shows masked packed SFT with eval and LoRA under dp × tp + SP × pp with ZeRO-1
(full fine-tuning at 8 ranks is ``test_parity``'s), its adapters within 1e-5 of the reference's and
every frozen base parameter bit-identical on every rank.
"""

import numpy as np
import pytest

from neuron_parallel.checkpoint import CheckpointTensors, list_checkpoints

from ..conftest import max_rel_diff, read_metrics, torchrun, write_job
from .conftest import chatml_rows, train_rows
from .dist_lora_check import HOOK

STEPS = 4
GLOBAL_BATCH = 8
TRAIN = dict(max_steps=STEPS, save_every=0, keep_checkpoints=1, lr=3e-3, warmup_steps=1, seed=2, eval_every=2)
BLOCK = 64
LORA = dict(lora=dict(r=4, alpha=8.0), optimizer="sgd", lr=0.5)

LAYOUTS = {  # name: (ranks, parallel, micro_batch_size)
    "dp2-zero1": (2, dict(zero_1=True), 2),
    "tp2-sp": (2, dict(tp=2, sequence_parallel=True), 4),
    "pp2": (2, dict(pp=2, num_microbatches=2), 4),
    "dp2-tp2-pp2-lora": (8, dict(tp=2, pp=2, sequence_parallel=True, zero_1=True, num_microbatches=2), 2),
}


@pytest.fixture(scope="module")
def chat_rows(tiny_world, tmp_path_factory):
    return chatml_rows(tiny_world, tmp_path_factory.mktemp("sft"), BLOCK)


def _run(run_dir, world, parallel, mbs, model, rows, lora=False):
    train = dict(TRAIN, global_batch_size=GLOBAL_BATCH, micro_batch_size=mbs, **(LORA if lora else {}))
    hooks = [HOOK] if lora else []
    metrics, proc = train_rows(
        run_dir, model, rows, world=world, block_size=BLOCK, parallel=parallel, train=train, hooks=hooks
    )
    if lora:
        for x in proc.results:
            assert x["checked"] > 0 and x["changed"] == [] and x["all_adapters"], x  # the base is frozen, bit for bit
    return metrics


@pytest.fixture(scope="module")
def reference(tiny_world, chat_rows, tmp_path_factory):
    return _run(tmp_path_factory.mktemp("ref"), 1, None, 2, tiny_world["model"], chat_rows)


@pytest.fixture(scope="module")
def lora_reference(tiny_world, chat_rows, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("lora-ref")
    return _run(run_dir, 1, None, 2, tiny_world["model"], chat_rows, lora=True), run_dir


def test_rows_are_masked_packed_documents_with_uneven_trained_tokens(chat_rows):
    from datasets import load_from_disk

    rows = load_from_disk(chat_rows.path).with_format("numpy")[:]
    trained = (rows["labels"] != -100).sum(1)
    assert chat_rows.attention == "document"
    assert (rows["position_ids"] == 0).sum(1).min() >= 1
    assert 0 < trained.sum() < rows["labels"].size  # prompts are masked
    assert len(np.unique(trained)) > 3  # rows differ in trained tokens: normalisation matters
    assert chat_rows.eval_path and chat_rows.num_eval_blocks > 0


# The 8-rank combination runs in `make test-slow` (and CI); the fast tier runs each part alone.
SLOW = {"dp2-tp2-pp2-lora"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in LAYOUTS])
def test_sft_with_eval_matches_one_process(name, request, tiny_world, chat_rows, tmp_path):
    world, parallel, mbs = LAYOUTS[name]
    lora = name.endswith("-lora")
    if lora:
        reference, ref_dir = request.getfixturevalue("lora_reference")
    else:
        reference = request.getfixturevalue("reference")
    ours = _run(tmp_path, world, parallel, mbs, tiny_world["model"], chat_rows, lora=lora)
    assert [m["step"] for m in ours] == list(range(1, STEPS + 1))
    assert [m["step"] for m in ours if "eval_loss" in m] == [2, 4]
    for a, b in zip(ours, reference):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (a["step"], a["loss"], b["loss"])
        assert a["trained_tokens"] == b["trained_tokens"]
        if "eval_loss" in b:
            assert abs(a["eval_loss"] - b["eval_loss"]) <= 1e-5 * abs(b["eval_loss"]), (a, b)
    if lora:
        mine, want = CheckpointTensors(list_checkpoints(tmp_path)[-1]), CheckpointTensors(list_checkpoints(ref_dir)[-1])
        names = sorted(want.names("model"))
        assert sorted(mine.names("model")) == names and names and all(n.endswith((".lora_A", ".lora_B")) for n in names)
        rel = {n: max_rel_diff(mine.read(n), want.read(n)) for n in names}
        assert max(rel.values()) <= 1e-5, max(rel.items(), key=lambda kv: kv[1])


@pytest.mark.slow
def test_early_stopping_ends_with_a_checkpoint_and_a_retry_stays_stopped(tiny_world, chat_rows, tmp_path):
    """A learning rate far too high makes the eval loss climb: after 2 evals without a new best
    the run ends with a checkpoint of that step; run again (a retry), it resumes there and trains
    no further step."""
    from neuron_parallel.checkpoint import list_checkpoints

    train = dict(TRAIN, max_steps=8, eval_every=1, early_stopping_patience=2, lr=1.0, save_every=0)
    job = write_job(
        tmp_path,
        tiny_world["model"],
        chat_rows.path,
        eval_dataset=chat_rows.eval_path,
        world=1,
        block_size=BLOCK,
        train=dict(train, global_batch_size=4, micro_batch_size=4),
    )
    first = torchrun(job, 1, timeout=300)
    assert first.returncode == 0, first.tail()
    done = next(e for e in first.events if e["event"] == "done")
    stop = next(e for e in first.events if e["event"] == "early_stop")
    metrics = read_metrics(tmp_path)
    evals = [m["eval_loss"] for m in metrics]
    assert done["stopped_early"] and done["step"] == stop["step"] < 8
    assert min(evals[-2:]) >= min(evals[:-2])  # the last two evals found no better loss
    assert [int(p.name.split("-")[1]) for p in list_checkpoints(tmp_path)] == [stop["step"]]

    again = torchrun(job, 1, timeout=300)
    assert again.returncode == 0, again.tail()
    assert [e["step"] for e in again.events if e["event"] == "resumed"] == [stop["step"]]
    assert not [e for e in again.events if e["event"] == "step"]
    assert read_metrics(tmp_path) == metrics
