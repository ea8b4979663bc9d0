"""Inside torchrun (4 ranks: dp2 × tp2, sequence parallel, ZeRO-1): count the collectives of the
gradient reduction, clipping and optimizer step, and check the dp reduction runs during backward.

    run_ranks("tests/dist/dist_comm_check.py", 4, [WORK_DIR])   (neuron_parallel.testing.ranks)

Rank 0 writes two tiny Llama models (2 and 6 decoder layers) to WORK_DIR; every rank builds each
engine with ``build_engine`` and trains a step on random tokens, recorded by ``CollectiveLog``
(``neuron_parallel.testing.comm_audit``, whose module run audits a whole step against the
layout's minimum for ``test_comm.py``). Reported per depth: the collectives of ``reduce_and_clip`` and
``optimizer_step`` plus the dp ones of ``forward_backward`` (the gradient buckets), and the
number of parameters. Then, on the 6-layer model with buckets of an eighth of its gradients:
whether the first bucket's all-reduce was issued before backward's last tensor-parallel
collective (overlap) and how many buckets were reduced. One ``print_rank_result`` line per rank.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from neuron_parallel.batches import Batch
from neuron_parallel.config import DataConfig, JobConfig, ParallelConfig, TrainConfig
from neuron_parallel.engine import build_engine
from neuron_parallel.mesh import ParallelDims, close_distributed, exit_rank, init_distributed
from neuron_parallel.parallel.data_parallel import GradReducer
from neuron_parallel.parallel.dtensor import local
from neuron_parallel.testing.comm_audit import CollectiveLog, axis_names, engine_phases
from neuron_parallel.testing.ranks import print_rank_result

DEPTHS = (2, 6)
BATCH, SEQ, VOCAB = 2, 16, 256


def write_model(path: Path, layers: int) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)


def make_job(model: Path, work: Path) -> JobConfig:
    return JobConfig(
        model_path=str(model),
        dataset_path=str(work / "unused"),
        output_dir=str(work / "run"),
        data=DataConfig(block_size=SEQ),
        parallel=ParallelConfig.for_world(4, tp=2, sequence_parallel=True, zero_1=True),
        train=TrainConfig(micro_batch_size=BATCH, global_batch_size=2 * BATCH, max_grad_norm=1e-3),
    )


def batch(dims: ParallelDims, step: int) -> Batch:
    g = torch.Generator().manual_seed(100 * step + dims.coordinates()["dp_rank"])
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return Batch(ids[:, :-1], ids[:, 1:])


def step(engine, dims: ParallelDims, n: int) -> None:
    engine.forward_backward(batch(dims, n), 1.0 / (BATCH * SEQ))
    engine.reduce_and_clip()
    engine.optimizer_step(1e-3)


def count_reduction(engine, dims: ParallelDims) -> dict:
    """Collectives of one recorded step outside the activations' own (tp, pp) traffic."""
    log = CollectiveLog(axis_names(dims.mesh))
    with log, engine_phases(engine, log):
        step(engine, dims, 1)
    ours = [r for r in log.records if r.phase != "forward_backward" or r.axis == "dp"]
    return {"collectives": len(ours), "kinds": sorted({f"{r.phase}:{r.kind}:{r.axis}" for r in ours})}


def overlap(engine, dims: ParallelDims) -> dict:
    """With small buckets, does the dp reduction start while backward still runs? (That it
    equals the reduction after backward is tests/unit/test_comm_audit.py's business.)"""
    engine.grad_reducer.remove()
    grad_bytes = sum(local(p).numel() * 4 for p in engine.parameters())
    engine.grad_reducer = GradReducer(
        engine.parameters(), dims.mesh["dp"].get_group(), dims.dp, bucket_bytes=grad_bytes // 8
    )
    log = CollectiveLog(axis_names(dims.mesh))
    with log, engine_phases(engine, log):
        step(engine, dims, 2)
    fb = [(i, r) for i, r in enumerate(log.records) if r.phase == "forward_backward"]
    first_dp = min(i for i, r in fb if r.axis == "dp")
    last_tp = max(i for i, r in fb if r.axis == "tp")
    return {
        "buckets": len(engine.grad_reducer.buckets),
        "dp_during_backward": sum(r.axis == "dp" for _, r in fb),
        "started_before_backward_ended": first_dp < last_tp,
    }


def main() -> int:
    torch.set_num_threads(1)
    init_distributed("cpu")
    work = Path(sys.argv[1])
    if dist.get_rank() == 0:
        for layers in DEPTHS:
            write_model(work / f"llama{layers}", layers)
    dist.barrier()
    dims = ParallelDims(dp=2, pp=1, tp=2)
    result: dict = {"depths": {}}
    for layers in DEPTHS:
        engine = build_engine(make_job(work / f"llama{layers}", work), dims, torch.device("cpu"))
        result["depths"][str(layers)] = {**count_reduction(engine, dims), "num_params": len(engine.parameters())}
    result["overlap"] = overlap(engine, dims)
    print_rank_result(result)
    close_distributed()
    return 0


if __name__ == "__main__":
    exit_rank(main())
