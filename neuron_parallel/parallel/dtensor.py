"""The one place that turns DTensors into what local code needs: this rank's shard, the whole
tensor, the global slice a shard covers, and a gradient aligned to its parameter's layout.
Plain tensors pass through every helper unchanged, so callers need no ``isinstance`` checks."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (no communication); a plain tensor as is."""
    return t.to_local() if isinstance(t, DTensor) else t


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor (a collective over its mesh); a plain tensor as is."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def local_view(t: torch.Tensor) -> tuple[torch.Tensor, list[int], list[int]]:
    """``(local tensor, global shape, global offsets)`` of a DTensor shard or a plain tensor."""
    if isinstance(t, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        _, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        return t.to_local(), list(t.shape), list(offsets)
    return t, list(t.shape), [0] * t.dim()


def align_grad(p: torch.Tensor) -> None:
    """Redistribute ``p.grad`` to ``p``'s mesh and placements when a DTensor backward delivered
    it otherwise (``Partial`` grads are summed, a ``Replicate`` grad of a sharded weight is
    sliced). A collective over the mesh when anything changes; nothing for plain tensors."""
    g = p.grad
    if isinstance(g, DTensor) and (g.device_mesh != p.device_mesh or tuple(g.placements) != tuple(p.placements)):
        p.grad = g.redistribute(p.device_mesh, p.placements)
