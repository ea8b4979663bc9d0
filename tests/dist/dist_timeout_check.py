"""A checkpoint hook (run on warm ranks: ``torchrun(job, n, hooks=[HOOK])`` in the tests' conftest):
every rank reports how long each mesh axis group's collectives now wait for a peer, with one
``print_rank_result`` line per checkpoint."""

from __future__ import annotations

import torch
import torch.distributed as dist

from neuron_parallel.testing.ranks import print_rank_result

HOOK = f"{__name__}:report_timeouts"


def report_timeouts(trainer, step: int) -> None:
    groups = {axis: trainer.dims.group(axis) for axis in ("dp", "pp", "tp")}
    seconds = {axis: g._get_backend(torch.device("cpu")).options._timeout.total_seconds() for axis, g in groups.items()}
    print_rank_result({"rank": dist.get_rank(), "step": step, "timeouts": seconds})
