"""Optimizer construction, the learning-rate schedule, gradient reduction and clipping."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .config import TrainConfig
from .parallel.dtensor import full, local
from .parallel.zero import Zero1Optimizer

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
    one-kernel AdamW (plain tensors on CPU/CUDA). With ``dp_group`` the state is sharded over the
    data-parallel ranks (ZeRO-1)."""
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


def _buckets(grads: list[torch.Tensor], cap: int):
    bucket: list[torch.Tensor] = []
    size = 0
    for g in grads:
        nbytes = g.numel() * g.element_size()
        if bucket and (size + nbytes > cap or g.dtype != bucket[0].dtype):
            yield bucket
            bucket, size = [], 0
        bucket.append(g)
        size += nbytes
    if bucket:
        yield bucket


def all_reduce_grads(params: list[torch.nn.Parameter], group, world: int, bucket_bytes: int = 32 << 20) -> None:
    """Average gradients over a data-parallel group, in flat buckets (one collective per bucket
    rather than per tensor). Sum then divide: gloo has no AVG or PREMUL_SUM reduction."""
    if world == 1:
        return
    grads = [local(p.grad) for p in params if p.grad is not None]
    for bucket in _buckets(grads, bucket_bytes):
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat, group=group)
        flat.div_(world)
        offset = 0
        for g in bucket:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def clip_grad_norm(
    params: list[torch.nn.Parameter], max_norm: float, *, pp_group=None, norm_params: list | None = None
) -> torch.Tensor:
    """Clip by the true global norm: DTensor norms reduce over their tensor-parallel shards, and
    the squared sums of the pipeline stages are added across ``pp_group``. ``norm_params`` (default
    ``params``) are the ones counted, so a weight held twice is counted once. Returns the norm
    before clipping; ``max_norm <= 0`` only measures."""
    counted = params if norm_params is None else norm_params
    sq = torch.zeros((), dtype=torch.float32, device=params[0].device if params else "cpu")
    for p in counted:
        if p.grad is None:
            continue
        n = full(torch.linalg.vector_norm(p.grad.float()))
        sq += n.to(sq.device) ** 2
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(sq, group=pp_group)
    norm = sq.sqrt()
    total = norm.item()
    if max_norm > 0 and total > max_norm:
        coef = max_norm / (total + 1e-6)
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef)
    return norm
