"""Optimizer construction, the learning-rate schedule and gradient clipping. The dp gradient
reduction is ``neuron_parallel.parallel.data_parallel.GradReducer``."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .config import TrainConfig
from .parallel.dtensor import local
from .parallel.zero import Zero1Optimizer

FUSED_ADAMW_DEVICES = ("cpu", "cuda", "neuron")
"""Devices with torch's one-kernel AdamW (``torch._fused_adamw_``): CPU and CUDA in torch itself,
neuron through torch-neuronx. It takes DTensor parameters too (each rank updates its shards)."""
STATE_KEYS = ("exp_avg", "exp_avg_sq", "momentum_buffer")
"""The per-parameter optimizer state tensors a checkpoint stores (AdamW moments, SGD momentum)."""


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for optimizer step ``step`` (1-based): linear warm-up, then cosine decay to
    ``min_lr_ratio × lr`` at ``max_steps`` (or constant). A pure function of the step, so a
    resumed run follows the same schedule with nothing to restore."""
    if cfg.warmup_steps and step <= cfg.warmup_steps:
        return cfg.lr * step / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return cfg.lr
    span = max(1, cfg.max_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    floor = cfg.min_lr_ratio
    return cfg.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def param_groups(named_params: list[tuple[str, torch.nn.Parameter]], weight_decay: float) -> list[dict]:
    """Weight decay on matrices only; norms and biases are not decayed."""
    decay = [p for _, p in named_params if p.dim() >= 2]
    no_decay = [p for _, p in named_params if p.dim() < 2]
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(named_params: list, cfg: TrainConfig, *, fused: bool, dp_group=None):
    """AdamW (or SGD) over ``named_params`` with decay on matrices only. ``fused`` picks torch's
    one-kernel AdamW (on a device of ``FUSED_ADAMW_DEVICES``). With ``dp_group`` the state is
    sharded over the data-parallel ranks (ZeRO-1)."""
    groups = param_groups(named_params, cfg.weight_decay)
    if cfg.optimizer == "sgd":
        cls, defaults = torch.optim.SGD, dict(lr=cfg.lr)
    else:
        cls, defaults = torch.optim.AdamW, dict(lr=cfg.lr, betas=cfg.betas, eps=1e-8)
        if fused:
            defaults["fused"] = True
    if dp_group is not None:
        return Zero1Optimizer(named_params, groups, cls, dp_group=dp_group, **defaults)
    return cls(groups, **defaults)


def _counted_here(p: torch.Tensor) -> bool:
    """Whether this rank counts ``p`` in a norm summed over its mesh: a shard always, a replicated
    DTensor only on coordinate 0 of each mesh dim it is replicated over."""
    if not isinstance(p, DTensor):
        return True
    assert not any(pl.is_partial() for pl in p.grad.placements), "align gradients before clipping"
    coordinate = p.device_mesh.get_coordinate()
    return all(c == 0 for c, pl in zip(coordinate, p.placements) if pl.is_replicate())


@torch.no_grad()
def clip_grad_norm(
    params: list[torch.nn.Parameter], max_norm: float, *, groups=(), norm_params: list | None = None
) -> torch.Tensor:
    """Clip by the true global norm, as ``torch.nn.utils.clip_grad_norm_`` does and with no host
    sync: ``grad × min(1, max_norm / (norm + 1e-6))``. The squared norms of this rank's local
    shards (a DTensor replicated over a mesh dim counted on one coordinate of it) are summed in one
    tensor, then all-reduced once over each process group of ``groups`` (tensor parallel, then
    pipeline stages; None or single-rank groups are skipped); no collective per parameter.
    ``norm_params`` (default ``params``) are the ones this rank counts, so a weight held twice is
    counted once. Returns the norm before clipping (a 0-d tensor); ``max_norm <= 0`` only
    measures."""
    counted = [
        local(p.grad)
        for p in (params if norm_params is None else norm_params)
        if p.grad is not None and _counted_here(p)
    ]
    device = params[0].device if params else torch.device("cpu")
    if counted:
        sq = torch.stack(torch._foreach_norm(counted, dtype=torch.float32)).square().sum()
    else:
        sq = torch.zeros((), dtype=torch.float32, device=device)
    for group in groups:
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(sq, group=group)
    norm = sq.sqrt()
    if max_norm > 0:
        grads = [local(p.grad) for p in params if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, torch.clamp(max_norm / (norm + 1e-6), max=1.0).to(grads[0].dtype))
    return norm
