"""The unit tier's fixtures."""

import pytest
import torch.distributed as dist


@pytest.fixture
def world_of_one():
    """A real gloo process group of one rank in this process (no launch), for code that issues
    collectives."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()
