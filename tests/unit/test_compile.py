"""``train.compile``: each decoder layer compiles with its device's backend; the tiny model trains
the same with its layers compiled (inductor on CPU) as eagerly, on packed rows with every layer
recomputed, and keeps its parameter names. The training comparison is in the slow tier: inductor
compiles its C++ kernels with the system compiler, about 45 s from a cold cache on 2 loaded cores
(10 s warm)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from neuron_parallel.batches import Batch
from neuron_parallel.config import DataConfig, JobConfig, ParallelConfig, TrainConfig
from neuron_parallel.engine import build_engine, compile_layers
from neuron_parallel.mesh import ParallelDims

SEQ, ROWS, STEPS = 32, 4, 3


def train(model: str, *, compile: bool) -> tuple[list[float], list[str]]:
    """Losses (mean per token) of ``STEPS`` AdamW steps on fixed packed rows, and the parameter names."""
    job = JobConfig(
        model_path=model,
        dataset_path="unused",
        output_dir="unused",
        data=DataConfig(block_size=SEQ),
        parallel=ParallelConfig(activation_checkpointing=1),
        train=TrainConfig(micro_batch_size=ROWS, global_batch_size=ROWS, compile=compile),
    )
    engine = build_engine(job, ParallelDims(dp=1, pp=1, tp=1), torch.device("cpu"))
    positions = torch.cat([torch.arange(12), torch.arange(SEQ - 12)]).repeat(ROWS, 1)  # two documents a row
    losses = []
    for step in range(STEPS):
        ids = torch.randint(0, engine.config.vocab_size, (ROWS, SEQ + 1), generator=torch.Generator().manual_seed(step))
        loss = engine.forward_backward(Batch(ids[:, :-1], ids[:, 1:], positions), 1.0 / (ROWS * SEQ))
        engine.reduce_and_clip()
        engine.optimizer_step(1e-3)
        losses.append(loss.item() / (ROWS * SEQ))
    return losses, [name for name, _ in engine.named_parameters()]


def test_each_decoder_layer_compiles_in_place_with_its_devices_backend(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **options: calls.append((self, options)))
    layers = torch.nn.ModuleDict({str(i): torch.nn.Linear(2, 2) for i in (4, 5)})
    parts = [SimpleNamespace(model=SimpleNamespace(layers=layers, embed_tokens=None))]  # a later pipeline stage
    compile_layers(parts, SimpleNamespace(type="neuron"))  # torch-neuronx refuses dynamic shapes
    assert calls == [(layers["4"], {"backend": "neuron", "dynamic": False}), (layers["5"], calls[1][1])]
    calls.clear()
    for device in ("cuda", "cpu"):
        compile_layers(parts, SimpleNamespace(type=device))
    assert [options for _, options in calls] == [{"backend": "inductor"}] * 4


@pytest.mark.slow
def test_compiled_layers_train_as_eager_ones(tiny_world, world_of_one):
    from torch._dynamo.utils import counters

    eager, names = train(tiny_world["model"], compile=False)
    graphs = counters["stats"]["unique_graphs"]
    try:
        compiled, compiled_names = train(tiny_world["model"], compile=True)
        assert counters["stats"]["unique_graphs"] > graphs  # the layers did run compiled
    finally:
        torch._dynamo.reset()
    assert compiled == pytest.approx(eager, rel=1e-5) and compiled_names == names
