"""The host-side bookkeeping of a training step: rows' labelled-token counts from the data (no
tensor read), and metrics rows finished in windows (one read, the window's time shared)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from datasets import Dataset

from neuron_parallel.batches import IGNORE_INDEX, BlockStream, EvalRows
from neuron_parallel.step_log import PendingStep, StepRows


@pytest.fixture
def rows_path(tmp_path):
    """23 rows of 8 tokens, each with a different number of labelled positions."""
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 100, size=(23, 8))
    labels = np.where(rng.random((23, 8)) < 0.6, ids, IGNORE_INDEX)
    labels[3] = IGNORE_INDEX  # a row with no target at all
    Dataset.from_dict({"input_ids": ids.tolist(), "labels": labels.tolist()}).save_to_disk(str(tmp_path / "rows"))
    return tmp_path / "rows", labels


def test_a_steps_target_count_is_the_sum_over_every_ranks_rows(rows_path):
    path, labels = rows_path
    stream = BlockStream(path, seed=3)
    dp, mbs = 2, 3
    for step in range(1, 9):  # 8 steps of 6 rows: two epochs of 23 rows
        base = (step - 1) * dp * mbs
        parts = [stream.batch(base + r * mbs, mbs) for r in range(dp)]
        counted = sum(int((b.labels != IGNORE_INDEX).sum()) for b in parts)
        assert stream.num_targets(base, dp * mbs) == counted == sum(b.num_targets for b in parts)
        assert [b.targets for b in parts] == [int((b.labels != IGNORE_INDEX).sum()) for b in parts]
    assert BlockStream(path, seed=3).num_targets(0, 12) == stream.num_targets(0, 12)  # nothing cached changes it
    assert sorted(stream.indices(0, 23)) == list(range(23))  # one epoch reads every row once


def test_eval_rows_count_every_labelled_token_once(rows_path):
    path, labels = rows_path
    rows = EvalRows(path)
    assert rows.num_targets == int((labels != IGNORE_INDEX).sum())
    tail = rows.batch(20, 4)  # 3 rows and an empty one
    assert tail.inputs.shape == (4, 8) and tail.num_targets == int((labels[20:] != IGNORE_INDEX).sum())


def _pending(step: int, loss_sum: float, grad_norm: float, targets: int) -> PendingStep:
    return PendingStep(step, 1e-3, step * 64, targets, torch.tensor(loss_sum), torch.tensor(grad_norm))


def test_a_window_is_read_once_and_its_time_shared_among_its_steps(monkeypatch):
    clock = iter([10.0, 13.0, 20.0, 26.0])  # start, close (3 s for 3 steps), restart, close (6 s for 2)
    monkeypatch.setattr(time, "perf_counter", lambda: next(clock))
    log = StepRows(torch.device("cpu"), tokens_per_step=64)
    for step in (1, 2, 3):
        log.add(_pending(step, 2.0 * step, 0.5, targets=4))
    reads = []
    real_tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(t.shape) or real_tolist(t))
    first = log.close()
    assert reads == [(3, 2)]
    assert [r["step"] for r in first] == [1, 2, 3]
    assert [r["loss"] for r in first] == [0.5, 1.0, 1.5] and {r["grad_norm"] for r in first} == {0.5}
    assert [r["step_time_s"] for r in first] == [1.0, 1.0, 1.0] and first[0]["tokens_per_s"] == 64.0
    assert [r["elapsed_s"] for r in first] == [1.0, 2.0, 3.0]
    log.restart()  # 7 s of evaluation and checkpoint, left out of the step times
    log.add(_pending(4, 0.0, 1.0, targets=0))
    log.add(_pending(5, 3.0, 1.0, targets=3))
    second = log.close()
    assert [r["step_time_s"] for r in second] == [3.0, 3.0] and [r["elapsed_s"] for r in second] == [13.0, 16.0]
    assert [r["loss"] for r in second] == [0.0, 1.0]  # no labelled token: loss 0, not a division by zero
