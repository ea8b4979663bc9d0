"""Parallel dimensions and the device mesh they describe.

The mesh has axes ``("dp", "pp", "tp")``: tp innermost (adjacent ranks, the fastest links), then
pp, then dp. It is built on first use and passed explicitly; there is no global process group
state beyond what torch.distributed itself keeps.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass, field
from typing import NoReturn

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .utils import DEVICE_BACKENDS


def backend_for(device: str) -> str:
    """The torch.distributed backend that goes with a device type."""
    try:
        return DEVICE_BACKENDS[device]
    except KeyError:
        raise ValueError(f"device {device!r} is not one of {sorted(DEVICE_BACKENDS)}") from None


def local_device(device_type: str) -> torch.device:
    """This rank's device: cpu, or cuda/neuron indexed by LOCAL_RANK."""
    if device_type == "cpu":
        return torch.device("cpu")
    index = int(os.environ.get("LOCAL_RANK", "0"))
    getattr(torch, device_type).set_device(index)
    return torch.device(device_type, index)


def init_distributed(device_type: str) -> None:
    """Join the process group torchrun describes (a world of one when run without torchrun)."""
    if dist.is_initialized():
        return
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    dist.init_process_group(backend_for(device_type))


def close_distributed() -> None:
    """Leave the process group: a barrier first, so that no collective is in flight on any rank
    when the group goes away, then ``destroy_process_group``."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def exit_rank(code: int) -> NoReturn:
    """End this rank's process with ``code`` once its output is flushed, skipping interpreter
    finalization. Call it after :func:`close_distributed`, when every result is written: gloo's
    worker threads can still abort finalization ("terminate called without an active
    exception", SIGABRT) after all work is done, and a finished run's exit status must not
    depend on that race."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(slots=True)
class ParallelDims:
    """Degrees of data, pipeline and tensor parallelism, with the mesh built on first use."""

    dp: int
    pp: int
    tp: int
    device_type: str = "cpu"
    _mesh: DeviceMesh | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        for name in ("dp", "pp", "tp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp

    @property
    def mesh(self) -> DeviceMesh:
        """The ("dp", "pp", "tp") mesh over the current process group."""
        if self._mesh is None:
            actual = dist.get_world_size()
            if actual != self.world_size:
                raise ValueError(
                    f"the process group has {actual} ranks but dp × pp × tp = {self.dp} × {self.pp} × "
                    f"{self.tp} = {self.world_size}; launch {self.world_size} ranks or change the split"
                )
            self._mesh = init_device_mesh(
                self.device_type, (self.dp, self.pp, self.tp), mesh_dim_names=("dp", "pp", "tp")
            )
        return self._mesh

    def coordinates(self) -> dict[str, int]:
        """This rank's (dp_rank, pp_rank, tp_rank)."""
        mesh = self.mesh
        return {f"{axis}_rank": mesh[axis].get_local_rank() for axis in ("dp", "pp", "tp")}
