"""The parallel model of one rank: its stage modules, optimizer, and one training step's
forward, backward, gradient reduction and update.

``build_engine`` applies, in order: pipeline split → tensor/sequence parallelism →
activation checkpointing → materialisation and weight loading → optimizer (ZeRO-1 over dp when
asked). Everything degenerates cleanly to one rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from .checkpoint.tensors import HFWeights
from .config import JobConfig
from .mesh import ParallelDims
from .models.causal_lm import (
    CausalLMStage,
    build_meta_model,
    causal_lm_loss,
    load_config,
    load_weights,
    materialize,
    split_layers,
)
from .optim import all_reduce_grads, build_optimizer, clip_grad_norm


@dataclass
class Engine:
    """What one rank trains: its stage modules and the optimizer over their parameters."""

    job: JobConfig
    dims: ParallelDims
    device: torch.device
    config: object
    parts: list[CausalLMStage]
    optimizer: torch.optim.Optimizer = field(init=False)

    def __post_init__(self) -> None:
        self.optimizer = build_optimizer(self.named_parameters(), self.job.train)

    @property
    def tied(self) -> bool:
        return bool(getattr(self.config, "tie_word_embeddings", False))

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        seen, out = set(), []
        for part in self.parts:
            for name, p in part.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append((name, p))
        return out

    def parameters(self) -> list[nn.Parameter]:
        return [p for _, p in self.named_parameters()]

    def forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor, scale: float) -> torch.Tensor:
        """Run one micro-batch; gradients accumulate scaled by ``scale``. Returns its mean loss."""
        part = self.parts[0]
        part.seq_len = inputs.shape[1]
        inputs, labels = inputs.to(self.device), labels.to(self.device)
        loss = causal_lm_loss(part(inputs), labels)
        (loss * scale).backward()
        return loss.detach()

    def reduce_and_clip(self) -> torch.Tensor:
        """Average gradients over dp, then clip by the global norm; returns the norm."""
        mesh = self.dims.mesh
        all_reduce_grads(self.parameters(), mesh["dp"].get_group(), self.dims.dp)
        return clip_grad_norm(self.parameters(), self.job.train.max_grad_norm)

    def optimizer_step(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def model_tensors(self) -> dict[str, torch.Tensor]:
        return {name: p.detach() for name, p in self.named_parameters()}

    def optim_tensors(self) -> dict[str, torch.Tensor]:
        """Optimizer state this dp rank stores: ``<param name>.<state key>``."""
        names = {id(p): n for n, p in self.named_parameters()}
        out = {}
        for p, state in self.optimizer.state.items():
            for key, value in state.items():
                if key != "step" and torch.is_tensor(value):
                    out[f"{names[id(p)]}.{key}"] = value
        return out

    def load_checkpoint(self, tensors, step: int) -> None:
        """Restore parameters and optimizer state from ``CheckpointTensors``, whatever layout
        wrote them: every rank reads exactly the slices it now holds."""
        from .checkpoint.tensors import local_view

        load_weights_from = tensors
        for part in self.parts:
            load_weights(part, load_weights_from, tied=self.tied)
        for name, p in self.named_parameters():
            keys = [k for k in ("exp_avg", "exp_avg_sq", "momentum_buffer") if f"{name}.{k}" in tensors]
            if not keys:
                continue
            state = self.optimizer.state[p]
            for key in keys:
                value = torch.zeros_like(p)
                local, _, offsets = local_view(value)
                local.copy_(tensors.read(f"{name}.{key}", offsets, list(local.shape)))
                state[key] = value
            if "exp_avg" in keys:
                state["step"] = torch.tensor(float(step))


def build_engine(job: JobConfig, dims: ParallelDims, device: torch.device) -> Engine:
    """Build this rank's part of the model from ``job.model_path`` and its optimizer."""
    pc = job.parallel
    if pc.tp > 1 or pc.pp > 1 or pc.zero_1:
        raise ValueError(
            f"tp={pc.tp}, pp={pc.pp}, zero_1={pc.zero_1}: this build trains data parallel only; "
            "set parallel.tp=1, parallel.pp=1, parallel.zero_1=false"
        )
    config = load_config(job.model_path)
    full = build_meta_model(config)
    (layers,) = split_layers(config.num_hidden_layers, 1)
    stage = CausalLMStage(full, layers, first=True, last=True, recompute_every=pc.activation_checkpointing)
    materialize(stage, device)
    load_weights(stage, HFWeights(job.model_path), tied=bool(config.tie_word_embeddings))
    stage.train()
    return Engine(job=job, dims=dims, device=device, config=config, parts=[stage])
