"""Inside torchrun: train a LoRA job with the real entry point's ``run_training`` and, after the
last checkpoint, compare every frozen base parameter this rank holds with the base model's own
weights, bit for bit. Each rank prints one ``print_rank_result`` line.

    torchrun --nproc_per_node N tests/dist/dist_lora_check.py RUN_DIR/job.json
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from neuron_parallel.checkpoint.tensors import HFWeights
from neuron_parallel.config import JobConfig
from neuron_parallel.launch import print_rank_result
from neuron_parallel.mesh import exit_rank
from neuron_parallel.parallel.dtensor import local_view
from neuron_parallel.train import run_training

RESULT: dict = {}


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
    RESULT.update(
        rank=dist.get_rank(),
        checked=checked,
        changed=changed,
        trainable=len(trainable),
        all_adapters=all(n.endswith((".lora_A", ".lora_B")) for n in trainable),
    )


def main() -> int:
    torch.set_num_threads(1)
    run_training(JobConfig.load(sys.argv[1]), after_checkpoint=[check_base])
    print_rank_result(RESULT)
    return 0


if __name__ == "__main__":
    exit_rank(main())
