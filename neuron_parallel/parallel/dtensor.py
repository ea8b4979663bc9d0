"""The one place that turns DTensors into what local code needs: this rank's shard, the whole
tensor, the global slice a shard covers, and a gradient aligned to its parameter's layout.
Plain tensors pass through every helper unchanged, so callers need no ``isinstance`` checks."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate


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


def with_local(g: torch.Tensor, new_local: torch.Tensor, placements=None) -> torch.Tensor:
    """``g`` (a gradient) re-made around ``new_local``, a tensor of its local shard's shape (a view
    into a flat communication buffer): a DTensor keeps its mesh and global shape and takes
    ``placements`` (default its own); a plain tensor is ``new_local``. No communication."""
    if not isinstance(g, DTensor):
        return new_local
    return DTensor.from_local(
        new_local, g.device_mesh, placements or g.placements, run_check=False, shape=g.shape, stride=g.stride()
    )


def align_grad(p: torch.Tensor) -> None:
    """Redistribute ``p.grad`` to ``p``'s mesh and placements when a DTensor backward delivered
    it otherwise (``Partial`` grads are summed, a ``Replicate`` grad of a sharded weight is
    sliced). A collective over the mesh when anything changes; nothing for plain tensors."""
    g = p.grad
    if isinstance(g, DTensor) and (g.device_mesh != p.device_mesh or tuple(g.placements) != tuple(p.placements)):
        p.grad = g.redistribute(p.device_mesh, p.placements)


def _summed_dims(p: torch.Tensor) -> tuple[int, ...] | None:
    """The mesh dims where ``p.grad`` is ``Partial(sum)`` and ``p`` is ``Replicate``, when that is
    the only difference between them; None when the grad needs another change."""
    g = p.grad
    if g.device_mesh != p.device_mesh:
        return None
    dims = []
    for i, (have, want) in enumerate(zip(g.placements, p.placements)):
        if have == want:
            continue
        if not (have.is_partial() and getattr(have, "reduce_op", None) == "sum" and want.is_replicate()):
            return None
        dims.append(i)
    return tuple(dims)


def align_grads(params) -> None:
    """:func:`align_grad` for every parameter of ``params``, with one all-reduce per mesh dim for
    all the ``Partial`` gradients of one mesh and dtype together (a flat buffer), rather than one
    collective per parameter as ``DTensor.redistribute`` (one tensor at a time) would issue.
    Other mismatches (rare: a ``Replicate`` grad of a sharded weight, sliced locally) go through
    :func:`align_grad`. Every rank of a mesh must call it with the same parameters in the same
    order."""
    with torch.no_grad():
        pending = _pending_sums(params)
        for (mesh, dims, _), ps in pending.items():
            shards = [local(p.grad) for p in ps]
            flat = torch.cat([s.reshape(-1) for s in shards])
            for d in dims:
                dist.all_reduce(flat, group=mesh.get_group(d))
            for p, s, view in zip(ps, shards, flat.split([s.numel() for s in shards])):
                placements = [Replicate() if i in dims else pl for i, pl in enumerate(p.grad.placements)]
                p.grad = with_local(p.grad, view.view_as(s), placements)


def _pending_sums(params) -> dict[tuple, list[torch.Tensor]]:
    """The parameters whose grads only owe a sum, by (mesh, dims, dtype); the others aligned now."""
    pending: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        g = p.grad
        if not isinstance(g, DTensor) or (g.device_mesh == p.device_mesh and g.placements == p.placements):
            continue
        dims = _summed_dims(p)
        if dims is None:
            align_grad(p)
        else:
            pending.setdefault((g.device_mesh, dims, g.dtype), []).append(p)
    return pending
