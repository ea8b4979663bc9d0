"""Context parallelism trains and evaluates like one process.

Rows of 512 tokens packed from chat documents (loss on assistant turns only) are cut into the
load-balanced shards of ``neuron_parallel.parallel.context``, and documents cross the shard
boundaries: attention must gather every shard's keys and values and mask by global index and by
document, and gradients must add up over the cp ranks. Each layout runs the real entry point for
3 steps (eval after the last) with the one-process reference's global batch; train loss of every
step and the eval loss must agree within 1e-5 relative. A checkpoint written at cp2 (ZeRO-1
sharded over the dp × cp ranks) resumes at cp1 to the same losses.
"""

import shutil

import numpy as np
import pytest

from neuron_parallel.checkpoint import list_checkpoints

from .conftest import chatml_rows, train_rows

STEPS = 3
BLOCK = 512
ROWS = 4  # the global batch
TRAIN = dict(max_steps=STEPS, save_every=0, keep_checkpoints=1, lr=3e-3, warmup_steps=1, seed=2, eval_every=STEPS)

LAYOUTS = {  # name: (ranks, parallel, micro_batch_size)
    # ZeRO-1 shards the optimizer state over the two cp ranks (dp × cp); every layer recomputed.
    "cp2-zero1-recompute": (2, dict(cp=2, zero_1=True, activation_checkpointing=1), 4),
    "cp2-tp2-sp": (4, dict(cp=2, tp=2, sequence_parallel=True), 4),
    "cp2-pp2": (4, dict(cp=2, pp=2, num_microbatches=2), 4),
    "dp2-cp2-zero1": (4, dict(cp=2, zero_1=True), 2),
}
SLOW = {"dp2-cp2-zero1"}  # ZeRO-1 over dp × cp is in cp2-zero1-recompute's run; `make test-slow` adds dp


@pytest.fixture(scope="module")
def long_chat_rows(tiny_world, tmp_path_factory):
    return chatml_rows(tiny_world, tmp_path_factory.mktemp("cp-rows"), BLOCK)


def _run(run_dir, world, parallel, mbs, model, rows, *, resumed=None, **train):
    """Train the job of this layout; its metrics. ``resumed``: the step it must resume from."""
    train = dict(TRAIN, global_batch_size=ROWS, micro_batch_size=mbs, **train)
    metrics, proc = train_rows(run_dir, model, rows, world=world, block_size=BLOCK, parallel=parallel, train=train)
    assert [e["step"] for e in proc.events if e["event"] == "resumed"] == ([resumed] if resumed else [])
    return metrics


def _same(ours, reference, steps=range(STEPS)):
    for a, b in zip([ours[i] for i in steps], [reference[i] for i in steps]):
        assert a["step"] == b["step"]
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (a["step"], a["loss"], b["loss"])
        assert a["trained_tokens"] == b["trained_tokens"]
        if "eval_loss" in b:
            assert abs(a["eval_loss"] - b["eval_loss"]) <= 1e-5 * abs(b["eval_loss"]), (a, b)


@pytest.fixture(scope="module")
def reference(tiny_world, long_chat_rows, tmp_path_factory):
    return _run(tmp_path_factory.mktemp("ref"), 1, None, ROWS, tiny_world["model"], long_chat_rows)


def test_documents_cross_the_shard_boundaries(long_chat_rows):
    """At cp2 a row is cut into 4 chunks of 128: a document runs on across a cut where the position
    id there is not 0, and it is trained on both sides of it."""
    from datasets import load_from_disk

    rows = load_from_disk(long_chat_rows.path).with_format("numpy")[:]
    chunk = BLOCK // 4
    cuts = np.arange(chunk, BLOCK, chunk)
    positions, labelled = rows["position_ids"], rows["labels"] != -100
    crossing = (positions[:, cuts] != 0) & labelled[:, cuts] & labelled[:, cuts - 1]
    assert crossing.sum() >= 10, crossing.sum()
    assert (positions == 0).sum(1).min() >= 2  # packed: several documents a row


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in LAYOUTS])
def test_context_parallel_matches_one_process(name, reference, tiny_world, long_chat_rows, tmp_path):
    world, parallel, mbs = LAYOUTS[name]
    ours = _run(tmp_path, world, parallel, mbs, tiny_world["model"], long_chat_rows)
    assert [m["step"] for m in ours] == list(range(1, STEPS + 1))
    assert "eval_loss" in ours[-1]
    _same(ours, reference)


@pytest.mark.slow
def test_a_cp2_checkpoint_resumes_at_cp1(reference, tiny_world, long_chat_rows, tmp_path):
    """Checkpoints name every tensor by its Hugging Face name and global slice, so the ZeRO-1
    partitions of the cp ranks load at cp1: the resumed steps give the one-process losses."""
    model = tiny_world["model"]
    saves = dict(save_every=1, keep_checkpoints=0)
    _run(tmp_path / "cp2", 2, dict(cp=2, zero_1=True), ROWS, model, long_chat_rows, **saves)
    run = tmp_path / "cp1"
    shutil.copytree(tmp_path / "cp2", run)
    for later in list_checkpoints(run)[1:]:
        shutil.rmtree(later)
    ours = _run(run, 1, None, ROWS, model, long_chat_rows, resumed=1, **saves)
    assert [m["step"] for m in ours] == list(range(1, STEPS + 1))
    _same(ours, reference, steps=range(1, STEPS))


@pytest.mark.slow
def test_lora_at_cp2_matches_one_process(tiny_world, long_chat_rows, tmp_path):
    """LoRA adapters on the frozen base under cp2: the adapters' gradients are reduced over the cp
    ranks like any replicated parameter's; the losses are those of one process."""
    lora = {"lora": {"r": 4, "alpha": 8.0}}
    model = tiny_world["model"]
    one = _run(tmp_path / "one", 1, None, ROWS, model, long_chat_rows, **lora)
    ours = _run(tmp_path / "cp2", 2, dict(cp=2), ROWS, model, long_chat_rows, **lora)
    assert one[-1]["loss"] != one[0]["loss"]  # the adapters train
    _same(ours, one)
