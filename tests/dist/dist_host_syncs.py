"""Counts every tensor → Python conversion a training job makes, per optimizer step, from outside
the trainer: run on every rank under torchrun (``neuron_parallel.testing.ranks.run_ranks``) as

    dist_host_syncs.py JOBS_JSON

where JOBS_JSON lists ``{"name": ..., "job": <job.json>}``. Before any job starts, ``Tensor.item``,
``tolist``, ``numpy``, ``__int__``, ``__float__``, ``__bool__`` and ``__index__`` are replaced by
wrappers that count each call, and ``DeviceMesh.__init__`` by one that counts the meshes built;
then every job is trained in turn with ``neuron_parallel.train.train_job`` in one process group,
and each rank reports, per job, the counts by phase (``"setup"`` before step 1, the step being
trained or finished, ``"end"`` after the last) with the call sites.

What is counted: a conversion made while a job runs on the training thread (the background
checkpoint writer's thread is reported apart, under ``"thread <name>"``), with neuron_parallel code
on its stack. Left out: conversions made inside ``torch/optim/`` on a CPU tensor (torch's own
host-side optimizer step counters) and inside ``torch/distributed/device_mesh.py`` (a mesh's rank
tables; the meshes themselves are counted apart).
"""

from __future__ import annotations

import functools
import json
import os
import sys
import threading
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

import neuron_parallel
from neuron_parallel import train as train_module
from neuron_parallel.config import JobConfig
from neuron_parallel.mesh import init_distributed
from neuron_parallel.testing.ranks import print_rank_result

CONVERSIONS = ("item", "tolist", "numpy", "__int__", "__float__", "__bool__", "__index__")
_OURS = os.path.dirname(neuron_parallel.__file__) + os.sep
_TORCH = os.path.dirname(torch.__file__) + os.sep
_OPTIM = _TORCH + "optim" + os.sep
_DEVICE_MESH = _TORCH + os.path.join("distributed", "device_mesh.py")


class Tally:
    """Counts by phase and call site while ``active``."""

    def __init__(self) -> None:
        self.active = False
        self.phase: int | str = "setup"
        self.conversions: Counter = Counter()
        self.sites: Counter = Counter()
        self.meshes: Counter = Counter()

    def reset(self) -> None:
        self.__init__()

    def where(self) -> str:
        """The phase a call on this thread belongs to."""
        t = threading.current_thread()
        return str(self.phase) if t is threading.main_thread() else f"thread {t.name}"


TALLY = Tally()


def _site(frame) -> str | None:
    """The first frame outside torch above a conversion, as ``path:line (function)``; None when
    the conversion is left out (see the module docstring) or has no neuron_parallel code above it."""
    site, ours = None, False
    while frame is not None:
        name = frame.f_code.co_filename
        if site is None:
            if name.startswith(_DEVICE_MESH):
                return None
            if not name.startswith(_TORCH):
                site = f"{os.path.relpath(name)}:{frame.f_lineno} ({frame.f_code.co_name})"
        if name.startswith(_OURS):
            ours = True
        frame = frame.f_back
    return site if ours else None


def _in_optim_code(frame) -> bool:
    while frame is not None and frame.f_code.co_filename.startswith(_TORCH):
        if frame.f_code.co_filename.startswith(_OPTIM):
            return True
        frame = frame.f_back
    return False


def _counting(name: str, original):
    @functools.wraps(original)
    def wrapper(self, *args, **kwargs):
        if TALLY.active:
            caller = sys._getframe(1)
            if not (self.device.type == "cpu" and _in_optim_code(caller)):
                site = _site(caller)
                if site is not None:
                    phase = TALLY.where()
                    TALLY.conversions[phase] += 1
                    TALLY.sites[f"{phase} {name} {site}"] += 1
        return original(self, *args, **kwargs)

    return wrapper


def install() -> None:
    """Wrap the conversions, the mesh constructor and the trainer's step and loop."""
    for name in CONVERSIONS:
        setattr(torch.Tensor, name, _counting(name, getattr(torch.Tensor, name)))

    mesh_init = DeviceMesh.__init__

    def counted_mesh(self, *args, **kwargs):
        if TALLY.active:
            TALLY.meshes[TALLY.where()] += 1
        return mesh_init(self, *args, **kwargs)

    DeviceMesh.__init__ = counted_mesh

    trainer = train_module.Trainer
    step, run = trainer.train_step, trainer.run

    def train_step(self, number: int, *args, **kwargs):
        TALLY.phase = number
        return step(self, number, *args, **kwargs)

    def loop(self, *args, **kwargs):
        try:
            return run(self, *args, **kwargs)
        finally:
            TALLY.phase = "end"

    trainer.train_step, trainer.run = train_step, loop


def main(jobs_file: str) -> None:
    jobs = json.loads(Path(jobs_file).read_text())
    install()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    for entry in jobs:
        job = JobConfig.load(entry["job"])
        init_distributed(job.device, timeout_s=job.launch.timeout_s)
        TALLY.reset()
        TALLY.active = True
        train_module.train_job(job)
        TALLY.active = False
        dist.barrier()
        print_rank_result(
            {
                "name": entry["name"],
                "conversions": dict(TALLY.conversions),
                "meshes": dict(TALLY.meshes),
                "sites": dict(TALLY.sites),
            }
        )
    dist.barrier()


if __name__ == "__main__":
    from neuron_parallel.mesh import close_distributed, exit_rank

    main(sys.argv[1])
    close_distributed()
    exit_rank(0)
