"""ZeRO-1: optimizer state (AdamW moments, and with them the fp32 master weights, which are the
parameters themselves here) sharded across the data-parallel ranks.

Built on ``torch.distributed.optim.ZeroRedundancyOptimizer``, which partitions whole parameters
over the dp group, steps only the owned ones and broadcasts the updated values. It cannot take
DTensor parameters (``c10d.broadcast_`` has no sharding strategy), so it is given plain
parameters that alias each rank's local shards (same storage; no bucket view, which would
re-point ``.data`` and break the alias). That choice composes with TP (each tp rank runs its own
ZeRO over the shards it holds) and PP (each stage's parameters), unlike FSDP2, which would also
shard parameters and gradients (ZeRO-3) and so change the memory model the planner predicts.

Collectives: none in forward/backward; ``step`` broadcasts the updated parameters of each dp
rank from that rank, as one flat buffer per rank (and dtype): dp broadcasts carrying every
parameter once, whatever the number of parameters. ``ZeroRedundancyOptimizer.step`` itself
would broadcast every parameter on its own, and its bucketed mode
(``parameters_as_bucket_view``) re-points the parameters into its buckets, breaking the alias.
Gradients must already be averaged over dp (and aligned to their parameter's placement under
TP) when ``step`` is called: one all-reduce of the gradient bytes, overlapped with backward
(:class:`~neuron_parallel.parallel.data_parallel.GradReducer`). A reduce-scatter to the owners
would move half the bytes on the wire, but the owners here hold whole parameters placed greedily
by size (the planner's memory model replays that placement), scattered through the model, so
one owner's gradients are neither contiguous nor ready together: per-owner buckets could only
start once backward is over.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor

from .dtensor import local


class Zero1Optimizer:
    """An optimizer over ``named_params`` whose state is sharded across ``dp_group``."""

    def __init__(
        self, named_params: list[tuple[str, nn.Parameter]], groups: list[dict], optimizer_class, *, dp_group, **defaults
    ) -> None:
        alias_of = {id(p): nn.Parameter(local(p).detach(), requires_grad=p.requires_grad) for _, p in named_params}
        self.alias = [(name, p, alias_of[id(p)]) for name, p in named_params]
        alias_groups = [{**g, "params": [alias_of[id(p)] for p in g["params"]]} for g in groups]
        self.inner = ZeroRedundancyOptimizer(
            alias_groups,
            optimizer_class=optimizer_class,
            process_group=dp_group,
            parameters_as_bucket_view=False,
            **defaults,
        )

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    def step(self) -> None:
        for _, p, a in self.alias:
            a.grad = None if p.grad is None else local(p.grad)
        self.inner._local_step()  # ZeroRedundancyOptimizer.step() less its per-parameter broadcasts
        self._broadcast_updated()

    @torch.no_grad()
    def _broadcast_updated(self) -> None:
        """Every dp rank's updated parameters to the others: per owner rank and dtype, one flat
        broadcast; the receivers copy the values into their aliases (the model's storage)."""
        inner = self.inner
        group, me = inner.process_group, inner.rank
        pending = []
        for rank, groups in enumerate(inner._partition_parameters()):
            by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
            for g in groups:
                for a in g["params"]:
                    by_dtype.setdefault(a.dtype, []).append(a)
            for dtype, owned in by_dtype.items():
                sizes = [a.numel() for a in owned]
                if rank == me:
                    flat = torch.cat([a.detach().reshape(-1) for a in owned])
                else:
                    flat = torch.empty(sum(sizes), dtype=dtype, device=owned[0].device)
                src = dist.get_global_rank(group, rank)
                pending.append((dist.broadcast(flat, src=src, group=group, async_op=True), flat, owned, sizes, rank))
        for work, flat, owned, sizes, rank in pending:
            work.wait()
            if rank != me:
                torch._foreach_copy_(owned, [v.view_as(a) for v, a in zip(flat.split(sizes), owned)])

    def zero_grad(self, set_to_none: bool = True) -> None:
        for _, p, a in self.alias:
            p.grad = None
            a.grad = None

    def owned(self) -> list[tuple[str, nn.Parameter, nn.Parameter]]:
        """(name, parameter, alias) of the parameters whose state this dp rank holds."""
        mine = {id(a) for g in self.inner.optim.param_groups for a in g["params"]}
        return [(n, p, a) for n, p, a in self.alias if id(a) in mine]

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """``<name>.<key>`` → state tensor, as a DTensor with its parameter's layout under TP, so
        a checkpoint records the global slice it covers."""
        out = {}
        for name, p, a in self.owned():
            for key, value in self.inner.optim.state.get(a, {}).items():
                if key == "step" or not torch.is_tensor(value):
                    continue
                if isinstance(p, DTensor):
                    value = DTensor.from_local(
                        value, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
                    )
                out[f"{name}.{key}"] = value
        return out

    def load_state(self, state_of) -> None:
        """Install ``state_of(name, parameter)`` (the state dict of one parameter, its tensors
        local shards, or empty) for every parameter this dp rank owns."""
        for name, p, a in self.owned():
            state = state_of(name, p)
            if state:
                self.inner.optim.state[a] = state
