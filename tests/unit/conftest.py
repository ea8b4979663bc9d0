"""The unit tier's fixtures."""

from pathlib import Path

import pytest
import torch.distributed as dist

from neuron_parallel.checkpoint import tensors as tensors_module
from neuron_parallel.checkpoint import validate as validate_module
from neuron_parallel.utils import sha256_file


@pytest.fixture
def world_of_one():
    """A real gloo process group of one rank in this process (no launch), for code that issues
    collectives."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.fixture
def opened(monkeypatch):
    """Every path hashed or opened as safetensors by the checkpoint readers."""
    seen: list[Path] = []

    def spy_hash(path, *a, **k):
        seen.append(Path(path))
        return sha256_file(path, *a, **k)

    real = tensors_module._SafetensorsFile.__init__

    def spy_open(self, path):
        seen.append(Path(path))
        real(self, path)

    monkeypatch.setattr(validate_module, "sha256_file", spy_hash)
    monkeypatch.setattr(tensors_module._SafetensorsFile, "__init__", spy_open)
    return seen
