"""Metrics reporting read back with TensorBoard's own reader (EventAccumulator), the ETA of step
events and how it is printed. MLflow is checked on a real torchrun run (tests/dist/test_train.py)."""

from __future__ import annotations

import time

import pytest

from neuron_parallel.config import JobConfig, TrainConfig
from neuron_parallel.reporting import (
    TENSORBOARD_DIR,
    EtaClock,
    MetricsReporter,
    format_duration,
    metrics_reporter,
    peak_memory_bytes,
)


def tensorboard_scalars(run_dir, tag: str) -> dict[int, list[float]]:
    """Every value of ``tag`` in the run's event files, by step, as TensorBoard reads them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / TENSORBOARD_DIR), size_guidance={"scalars": 0})
    acc.Reload()
    out: dict[int, list[float]] = {}
    for event in acc.Scalars(tag):
        out.setdefault(event.step, []).append(event.value)
    return out


def record(step: int, loss: float) -> dict:
    return {"step": step, "loss": loss, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 100.0, "peak_memory_bytes": 2**30}


def test_a_resumed_run_holds_one_value_per_step_in_tensorboard(tmp_path):
    crashed = MetricsReporter(tmp_path, ["tensorboard"], start_step=0)
    for step in range(1, 6):
        crashed.log(record(step, 10.0 + step))
    # A crash after step 5, resumed from the checkpoint of step 3: the writer is never closed.
    with MetricsReporter(tmp_path, ["tensorboard"], start_step=3) as resumed:
        for step in range(4, 8):
            resumed.log(record(step, 20.0 + step))
    assert len(list((tmp_path / TENSORBOARD_DIR).glob("events.out.tfevents.*"))) == 2
    losses = tensorboard_scalars(tmp_path, "train/loss")
    assert losses == {1: [11.0], 2: [12.0], 3: [13.0], 4: [24.0], 5: [25.0], 6: [26.0], 7: [27.0]}
    assert tensorboard_scalars(tmp_path, "memory/peak_bytes")[7] == [2.0**30]
    assert set(tensorboard_scalars(tmp_path, "train/lr")) == set(range(1, 8))


def test_only_rank_0_reports_and_an_empty_list_reports_nowhere(tmp_path):
    job = JobConfig(model_path="m", dataset_path="d", output_dir=str(tmp_path), train=TrainConfig())
    assert metrics_reporter(job, rank=1, start_step=0).sinks == []
    quiet = JobConfig(model_path="m", dataset_path="d", output_dir=str(tmp_path), train=TrainConfig(report_to=[]))
    with metrics_reporter(quiet, rank=0, start_step=0) as reporter:
        reporter.log(record(1, 1.0))
    assert list(tmp_path.iterdir()) == []


def test_an_unknown_tracker_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match=r"train.report_to has \['wandb'\], not among \['tensorboard', 'mlflow'\]"):
        TrainConfig(report_to=["tensorboard", "wandb"])


def test_eta_is_the_mean_step_time_since_the_start_times_the_steps_left(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    clock = EtaClock(start_step=10, max_steps=20)
    now[0] += 5.0  # step 11: warm-up, 5 s
    assert clock.eta_s(11) == pytest.approx(9 * 5.0)
    now[0] += 2.0  # steps 12 and 13, 1 s each: the warm-up no longer counts
    assert clock.eta_s(13) == pytest.approx(7 * 1.0)
    now[0] += 3.0  # steps 14 to 16, logged every 3rd step
    assert clock.eta_s(16) == pytest.approx(4 * 1.0)


@pytest.mark.parametrize(
    "seconds, text", [(0, "0s"), (44.6, "45s"), (83, "1m23s"), (7500, "2h05m"), (3 * 86400 + 4 * 3600, "3d04h")]
)
def test_durations_print_in_two_units_at_most(seconds, text):
    assert format_duration(seconds) == text


def test_peak_memory_reads_the_devices_own_module_after_a_synchronize(monkeypatch):
    """The device module's statistics, after a synchronize (torch.neuron stands in for
    torch-neuronx's, which this machine has not); a device without statistics gives None."""
    import types

    import torch

    calls = []

    class DeviceModule:
        def synchronize(self, *index):
            calls.append(("synchronize", index))

        def max_memory_allocated(self, *index):
            calls.append(("max_memory_allocated", index))
            return 3 * 2**30

    monkeypatch.setattr(torch, "neuron", DeviceModule(), raising=False)
    assert peak_memory_bytes("neuron") == 3 * 2**30
    assert calls == [("synchronize", ()), ("max_memory_allocated", ())]
    calls.clear()
    assert peak_memory_bytes(types.SimpleNamespace(type="neuron", index=5)) == 3 * 2**30
    assert calls == [("synchronize", (5,)), ("max_memory_allocated", (5,))]
    monkeypatch.setattr(torch, "neuron", types.SimpleNamespace(), raising=False)  # no statistics of its own
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda *index: calls.append(("synchronize", index)))
    monkeypatch.setattr(torch.accelerator, "max_memory_allocated", lambda *index: 7)
    assert peak_memory_bytes("neuron") == 7 and calls[-1] == ("synchronize", ())

    def no_allocator(*index):
        raise RuntimeError("no device allocator registered")

    monkeypatch.setattr(torch.accelerator, "max_memory_allocated", no_allocator)
    assert peak_memory_bytes("neuron") is None
    assert peak_memory_bytes("cpu") > 2**20  # this process's peak resident set
