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
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend as C10dBackend  # what init_device_mesh takes options as
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


def init_distributed(device_type: str, timeout_s: float | None = None) -> None:
    """Join the process group torchrun describes (a world of one when run without torchrun).
    ``timeout_s`` (``launch.timeout_s``) is how long a collective waits for a peer before it
    raises; torch's default (30 minutes) when None."""
    if dist.is_initialized():
        return
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    timeout = timedelta(seconds=timeout_s) if timeout_s is not None else None
    dist.init_process_group(backend_for(device_type), timeout=timeout)


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
    timeout_s: float | None = None
    """How long a collective of each mesh axis's group waits for a peer (``launch.timeout_s``);
    torch's default when None. DeviceMesh creates those groups itself, and they do not inherit
    the world group's timeout."""
    _mesh: DeviceMesh | None = field(default=None, repr=False)
    _axes: dict[str, DeviceMesh] = field(default_factory=dict, repr=False)
    _coordinates: dict[str, int] | None = field(default=None, repr=False)

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
                self.device_type,
                (self.dp, self.pp, self.tp),
                mesh_dim_names=("dp", "pp", "tp"),
                backend_override=self._axis_options(),
            )
        return self._mesh

    def _axis_options(self) -> dict | None:
        """Backend options carrying ``timeout_s`` for every axis, or None for torch's default."""
        if self.timeout_s is None:
            return None
        backend = dist.get_backend()
        options = {}
        for axis in ("dp", "pp", "tp"):
            opts = dist.ProcessGroupNCCL.Options() if backend == "nccl" else C10dBackend.Options(backend)
            opts._timeout = timedelta(seconds=self.timeout_s)
            options[axis] = opts
        return options

    def set_timeout(self, timeout_s: float) -> None:
        """From now on, collectives of the world group and of every axis group wait ``timeout_s``
        for a peer (``launch.timeout_s`` after the first step's ``launch.first_step_timeout_s``).
        gloo and nccl take the change; other backends keep the timeout they were created with
        (torch changes it for those two only)."""
        self.timeout_s = timeout_s
        groups = [dist.group.WORLD] + [self.group(axis) for axis in ("dp", "pp", "tp")]
        for group in groups:
            if dist.get_backend(group) in ("gloo", "nccl"):
                dist.distributed_c10d._set_pg_timeout(timedelta(seconds=timeout_s), group)

    def axis(self, name: str) -> DeviceMesh:
        """The one-dimensional mesh of axis ``name`` (``"dp"``, ``"pp"`` or ``"tp"``), built once:
        ``mesh[name]`` builds a new ``DeviceMesh`` at every call."""
        sub = self._axes.get(name)
        if sub is None:
            sub = self._axes[name] = self.mesh[name]
        return sub

    def group(self, name: str) -> dist.ProcessGroup:
        """The process group of axis ``name``."""
        return self.axis(name).get_group()

    def coordinates(self) -> dict[str, int]:
        """This rank's (dp_rank, pp_rank, tp_rank)."""
        if self._coordinates is None:
            self._coordinates = {f"{axis}_rank": self.axis(axis).get_local_rank() for axis in ("dp", "pp", "tp")}
        return dict(self._coordinates)
