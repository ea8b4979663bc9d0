"""A checkpoint hook for LoRA jobs (run on warm ranks: ``torchrun(job, n, hooks=[HOOK])`` in the
tests' conftest): after the last checkpoint, compare every frozen base parameter this rank holds
with the base model's own weights, bit for bit. Each rank prints one ``print_rank_result`` line.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from neuron_parallel.checkpoint.tensors import HFWeights
from neuron_parallel.parallel.dtensor import local_view
from neuron_parallel.testing.ranks import print_rank_result

HOOK = f"{__name__}:check_base"


def check_base(trainer, step: int) -> None:
    """The frozen base, as this rank holds it, against the base model's safetensors."""
    if step != trainer.job.train.max_steps:
        return
    weights = HFWeights(trainer.job.model_path)
    changed, checked = [], 0
    for name, p in trainer.engine.frozen_parameters():
        local, _, offsets = local_view(p.detach())
        key = "model.embed_tokens.weight" if name == "lm_head.weight" and name not in weights else name
        original = weights.read(key, offsets, list(local.shape)).to(local.dtype)
        checked += 1
        if not torch.equal(local, original):
            changed.append(name)
    trainable = [n for n, _ in trainer.engine.named_parameters()]
    print_rank_result(
        dict(
            rank=dist.get_rank(),
            checked=checked,
            changed=changed,
            trainable=len(trainable),
            all_adapters=all(n.endswith((".lora_A", ".lora_B")) for n in trainable),
        )
    )
