"""Low-rank adapters (LoRA) on the linear layers of a :class:`CausalLMStage`, tensor parallel.

A targeted ``nn.Linear`` becomes a :class:`LoRALinear`: the frozen base weight plus two trainable
tensors, ``lora_A`` (r × in) and ``lora_B`` (out × r), computing
``W x + b + (alpha / r) · B A dropout(x)`` as peft's LoRA layer does (A Kaiming-uniform, B zero,
so training starts from the base model). Parameter names are the layer's plus ``.lora_A`` /
``.lora_B``; export turns them into peft's ``base_model.model.<layer>.lora_A.weight``.

Under tensor parallelism the adapter follows its layer, so it adds no collective of its own in
the forward pass:

* column-parallel layer (q/k/v/gate/up; the weight ``Shard(0)``): B is sharded on its output
  dimension (``Shard(0)``) and A replicated. ``A x`` is computed whole on every rank and ``B``
  maps it to this rank's output columns. Backward: A's gradient is a sum over the tp ranks'
  output columns, ``Partial`` until :func:`~neuron_parallel.parallel.tensor.align_grad_placements`
  all-reduces it (r × in elements).
* row-parallel layer (o/down; the weight ``Shard(1)``): A is sharded on its input dimension
  (``Shard(1)``) and B replicated. ``A x`` is a partial sum over the tp ranks' input columns, and
  so is ``B (A x)``: it joins the base layer's partial output and is reduced by the same
  all-reduce (reduce-scatter under sequence parallelism). Backward: B's gradient is complete on
  every rank; A's is local.
* K/V projections with replicated KV heads (tp > num_key_value_heads): B is laid out like the
  weight on the ``(tp_kv, tp_rep)`` mesh and A replicated; gradients are summed over the
  replicas (B) and over all tp ranks (A) by ``align_grad_placements``.

Every base parameter is frozen (``requires_grad=False``: no gradient, no optimizer state) except
``modules_to_save`` (``lm_head``, ``embed_tokens``), trained in full.
"""

from __future__ import annotations

import hashlib
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from ..config import LoraConfig
from .dtensor import local_view

ADAPTER_SUFFIXES = (".lora_A", ".lora_B")


class LoRALinear(nn.Linear):
    """``nn.Linear`` with a low-rank adapter (see the module docstring). Built by
    :func:`add_lora` from an existing linear layer, so tensor-parallel styles and loading by name
    treat the base weight as before."""

    lora_A: nn.Parameter
    lora_B: nn.Parameter
    lora_scale: float
    lora_dropout: float
    lora_enabled = True
    """False runs the base layer alone (the reference model of preference tuning)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        if not self.lora_enabled:
            return out
        z = F.dropout(x, self.lora_dropout, self.training) if self.lora_dropout else x
        return out + F.linear(F.linear(z, self.lora_A), self.lora_B) * self.lora_scale


def is_adapter(name: str) -> bool:
    """Whether parameter ``name`` is a LoRA tensor."""
    return name.endswith(ADAPTER_SUFFIXES)


def add_lora(stage: nn.Module, cfg: LoraConfig) -> nn.Module:
    """Give every targeted linear layer of ``stage``'s decoder layers an adapter, in place, on the
    META device (before tensor parallelism, materialisation and loading). Call
    :func:`freeze_base` once the stage is sharded and materialised."""
    for layer in stage.model.layers.values():
        for parent in (layer.self_attn, layer.mlp):
            for name in cfg.target_modules:
                linear = getattr(parent, name, None)
                if isinstance(linear, nn.Linear):
                    _to_lora(linear, cfg)
    return stage


def _to_lora(linear: nn.Linear, cfg: LoraConfig) -> None:
    device = linear.weight.device
    linear.__class__ = LoRALinear
    linear.lora_A = nn.Parameter(torch.empty(cfg.r, linear.in_features, device=device))
    linear.lora_B = nn.Parameter(torch.empty(linear.out_features, cfg.r, device=device))
    linear.lora_scale = cfg.alpha / cfg.r
    linear.lora_dropout = cfg.dropout


def freeze_base(stage: nn.Module, cfg: LoraConfig, *, tied: bool = False) -> None:
    """Only adapters and ``modules_to_save`` keep ``requires_grad``. With tied embeddings
    ``lm_head`` and ``embed_tokens`` are one weight (two copies on different pipeline stages):
    naming either trains both."""
    saved = set(cfg.modules_to_save)
    if tied and saved & {"lm_head", "embed_tokens"}:
        saved |= {"lm_head", "embed_tokens"}
    keep = tuple(f"{m}." for m in saved)
    for name, p in stage.named_parameters():
        p.requires_grad_(is_adapter(name) or any(f".{k}" in f".{name}" for k in keep))


@torch.no_grad()
def init_adapters(stage: nn.Module, seed: int) -> None:
    """Initialise every adapter of ``stage`` as peft does (A Kaiming-uniform with a = √5, B zero),
    from a generator seeded by ``seed`` and the parameter's name: the same full tensor whatever
    the layout, of which each rank keeps its slice."""
    for name, p in stage.named_parameters():
        if not name.endswith(".lora_A"):
            if name.endswith(".lora_B"):
                local_view(p)[0].zero_()
            continue
        digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
        g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
        fan_in = p.shape[1]
        bound = math.sqrt(6.0 / ((1 + 5) * fan_in))  # kaiming_uniform_(a=sqrt(5)): gain² = 2 / (1 + a²)
        whole = torch.empty(tuple(p.shape)).uniform_(-bound, bound, generator=g)
        local, _, offsets = local_view(p)
        piece = whole[tuple(slice(o, o + n) for o, n in zip(offsets, local.shape))]
        local.copy_(piece.to(local.device, local.dtype))


class LoRAColwise(ColwiseParallel):
    """ColwiseParallel for a :class:`LoRALinear`: weight, bias and ``lora_B`` ``Shard(0)``,
    ``lora_A`` replicated."""

    def _partition_linear_fn(self, name, module, device_mesh):
        for pname, param in list(module.named_parameters(recurse=False)):
            place = [Replicate()] if pname == "lora_A" else [Shard(0)]
            dist = distribute_tensor(param, device_mesh, place, src_data_rank=self.src_data_rank)
            module.register_parameter(pname, nn.Parameter(dist, requires_grad=param.requires_grad))


class LoRARowwise(RowwiseParallel):
    """RowwiseParallel for a :class:`LoRALinear`: weight and ``lora_A`` ``Shard(1)``, bias and
    ``lora_B`` replicated."""

    def _partition_linear_fn(self, name, module, device_mesh):
        super()._partition_linear_fn(name, module, device_mesh)
        for pname, place in (("lora_A", Shard(1)), ("lora_B", Replicate())):
            param = getattr(module, pname)
            dist = distribute_tensor(param, device_mesh, [place], src_data_rank=self.src_data_rank)
            module.register_parameter(pname, nn.Parameter(dist, requires_grad=param.requires_grad))
