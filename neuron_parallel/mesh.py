"""Parallel dimensions and the device mesh they describe.

The mesh has axes ``("dp", "cp", "pp", "tp")``: tp innermost (adjacent ranks, the fastest links),
then pp, then cp (context parallelism: each row's sequence split over the cp ranks, which
exchange keys and values in every attention layer, ``neuron_parallel.parallel.context``), then
dp. The cp axis exists only when cp > 1 (an axis of one rank would only create process groups of
one), and with it the flattened ``dp_cp`` axis: the ranks that hold the same parameters and
train on different tokens, over which gradients are reduced and ZeRO-1 shards the optimizer
state. Without cp, ``dp_cp`` is the dp axis. The mesh and every axis are built on first use,
once, and passed explicitly; there is no global process group state beyond what
torch.distributed itself keeps.
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
    """Degrees of data, context, pipeline and tensor parallelism, with the mesh built on first use."""

    dp: int
    pp: int
    tp: int
    cp: int = 1
    device_type: str = "cpu"
    timeout_s: float | None = None
    """How long a collective of each mesh axis's group waits for a peer (``launch.timeout_s``);
    torch's default when None. DeviceMesh creates those groups itself, and they do not inherit
    the world group's timeout."""
    _mesh: DeviceMesh | None = field(default=None, repr=False)
    _axes: dict[str, DeviceMesh] = field(default_factory=dict, repr=False)
    _coordinates: dict[str, int] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        for name in ("dp", "cp", "pp", "tp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.pp * self.tp

    @property
    def axis_names(self) -> tuple[str, ...]:
        """The mesh's axes, outermost first: ("dp", "cp", "pp", "tp"), without cp when cp = 1."""
        return ("dp", "cp", "pp", "tp") if self.cp > 1 else ("dp", "pp", "tp")

    @property
    def mesh(self) -> DeviceMesh:
        """The mesh of :attr:`axis_names` over the current process group."""
        if self._mesh is None:
            actual = dist.get_world_size()
            if actual != self.world_size:
                raise ValueError(
                    f"the process group has {actual} ranks but dp × cp × pp × tp = {self.dp} × {self.cp} × "
                    f"{self.pp} × {self.tp} = {self.world_size}; launch {self.world_size} ranks or change the split"
                )
            options = self._axis_options()
            self._mesh = init_device_mesh(
                self.device_type,
                tuple(getattr(self, axis) for axis in self.axis_names),
                mesh_dim_names=self.axis_names,
                backend_override={a: options[a] for a in self.axis_names} if options else None,
            )
            if self.cp > 1:
                flat = options["dp_cp"] if options else None
                self._axes["dp_cp"] = self._mesh["dp", "cp"]._flatten("dp_cp", backend_override=flat)
        return self._mesh

    def _axis_options(self) -> dict | None:
        """Backend options carrying ``timeout_s`` for every axis, or None for torch's default."""
        if self.timeout_s is None:
            return None
        backend = dist.get_backend()
        options = {}
        for axis in ("dp", "cp", "pp", "tp", "dp_cp"):
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
        axes = self.axis_names + (("dp_cp",) if self.cp > 1 else ())
        groups = [dist.group.WORLD] + [self.group(axis) for axis in axes]
        for group in groups:
            if dist.get_backend(group) in ("gloo", "nccl"):
                dist.distributed_c10d._set_pg_timeout(timedelta(seconds=timeout_s), group)

    def axis(self, name: str) -> DeviceMesh:
        """The one-dimensional mesh of axis ``name`` (``"dp"``, ``"cp"`` when cp > 1, ``"pp"``,
        ``"tp"``, or ``"dp_cp"``), built once: ``mesh[name]`` builds a new ``DeviceMesh`` at every
        call."""
        if name == "dp_cp" and self.cp == 1:
            name = "dp"
        if name not in self._axes:
            mesh = self.mesh  # with cp > 1, builds the dp_cp axis too
            if name not in self._axes:
                self._axes[name] = mesh[name]
        return self._axes[name]

    def group(self, name: str) -> dist.ProcessGroup:
        """The process group of axis ``name``."""
        return self.axis(name).get_group()

    def coordinates(self) -> dict[str, int]:
        """This rank's (dp_rank, cp_rank, pp_rank, tp_rank); cp_rank is 0 without cp."""
        if self._coordinates is None:
            self._coordinates = {
                f"{axis}_rank": self.axis(axis).get_local_rank() if axis in self.axis_names else 0
                for axis in ("dp", "cp", "pp", "tp")
            }
        return dict(self._coordinates)

    @property
    def dp_cp(self) -> int:
        """Ranks that hold the same parameters and train on different tokens: dp × cp."""
        return self.dp * self.cp

    @property
    def dp_cp_rank(self) -> int:
        """This rank's place among them (its rank in the ``dp_cp`` group): dp_rank · cp + cp_rank."""
        c = self.coordinates()
        return c["dp_rank"] * self.cp + c["cp_rank"]
