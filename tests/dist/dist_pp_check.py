"""Pipeline-parallel parity check, run under torchrun (every rank is one pp rank):

    run_ranks("tests/dist/dist_pp_check.py", 2, ["NAME=--schedule 1f1b --mb 4", ...])

(``neuron_parallel.testing.ranks.run_ranks``; the cases run one after another in one launch.)

A tiny Llama is trained for a few SGD steps by one process (plain Hugging Face forward, on every
rank) and by the pipeline (meta model → this rank's stages → materialise → load the reference's
weights from safetensors). Every step's loss and, at the end, every weight this rank holds must
match the reference. Every rank prints one result line per case (``print_rank_result``); exits
non-zero on a mismatch.
"""

from __future__ import annotations

import argparse
import contextlib
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from transformers import LlamaConfig, LlamaForCausalLM

from neuron_parallel.checkpoint.tensors import HFWeights
from neuron_parallel.mesh import close_distributed, exit_rank
from neuron_parallel.models.causal_lm import build_meta_model, causal_lm_loss, load_weights, materialize
from neuron_parallel.parallel.pipeline import (
    PipelineRunner,
    build_stages,
    stage_ids_for_rank,
    sum_tied_embedding_grads,
)
from neuron_parallel.testing.ranks import print_rank_result

BATCH, SEQ, VOCAB, LR, TOL = 8, 32, 256, 0.1, 1e-5


def tiny_config(tied: bool) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=VOCAB,
        max_position_embeddings=128,
        tie_word_embeddings=tied,
        attn_implementation="sdpa",
    )


def mean_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The mean cross entropy of one (micro)batch: every position has a label here."""
    return causal_lm_loss(logits, labels) / labels.numel()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def case_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--mb", type=int, default=4, help="microbatches per step() call")
    ap.add_argument("--virtual-stages", type=int, default=1)
    ap.add_argument("--recompute", type=int, default=0, help="checkpoint every k-th layer")
    ap.add_argument("--layer-split", default=None, help="comma-separated layers per stage")
    ap.add_argument("--accum", type=int, default=1, help="step() calls per optimizer step")
    ap.add_argument("--tied", action="store_true")
    ap.add_argument(
        "--loss-parallel", action="store_true", help="vocab-parallel lm_head on a tp mesh of 1: DTensor logits and loss"
    )
    ap.add_argument("--steps", type=int, default=4)
    return ap.parse_args(argv)


def run_case(args: argparse.Namespace) -> dict:
    """One parity case on the whole world (every rank one pp rank); this rank's result."""
    rank, pp = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    if args.loss_parallel:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (pp, 1), mesh_dim_names=("pp", "tp"))
        group = mesh["pp"].get_group()
    config = tiny_config(args.tied)

    # The single-process reference: same seed on every rank, so every rank has identical weights.
    torch.manual_seed(0)
    ref = LlamaForCausalLM(config).train()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    initial = {k: v.detach().clone() for k, v in ref.state_dict().items()}

    shared = [tempfile.mkdtemp(prefix="pp_check_") if rank == 0 else None]
    dist.broadcast_object_list(shared, src=0)
    weights_dir = Path(shared[0])
    if rank == 0:
        state = {k: v.detach().contiguous() for k, v in ref.state_dict().items()}
        if args.tied:  # as save_pretrained does: the tied head is not stored
            state.pop("lm_head.weight")
        save_file(state, str(weights_dir / "model.safetensors"))
    dist.barrier()

    split = [int(n) for n in args.layer_split.split(",")] if args.layer_split else None
    ids = stage_ids_for_rank(rank, pp, args.virtual_stages, args.schedule)
    stages = build_stages(
        build_meta_model(config),
        config,
        pp_rank=rank,
        pp=pp,
        virtual_stages=args.virtual_stages,
        schedule=args.schedule,
        layer_split=split,
        recompute_every=args.recompute,
    )
    if args.loss_parallel:
        # As the TP module would: shard on meta, before materialising and building the runner.
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

        for stage in stages:
            if stage.lm_head is not None:
                plan = {"lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
                parallelize_module(stage, mesh["tp"], plan)
                assert isinstance(stage.lm_head.weight, DTensor)
    source = HFWeights(weights_dir)
    for stage in stages:
        materialize(stage, torch.device("cpu"))
        load_weights(stage, source, tied=args.tied)
        stage.train()
    dist.barrier()
    if rank == 0:
        shutil.rmtree(weights_dir)

    runner = PipelineRunner(
        stages,
        ids,
        pp * args.virtual_stages,
        pp_group=group,
        device=torch.device("cpu"),
        schedule=args.schedule,
        num_microbatches=args.mb,
        loss_fn=mean_loss,
        loss_scale=1.0 / (args.accum * args.mb),
    )
    params = {id(p): p for s in stages for p in s.parameters()}
    opt = torch.optim.SGD(params.values(), lr=LR)

    ok, worst_loss = True, 0.0
    per = BATCH // args.accum
    t0 = time.perf_counter()
    for step in range(args.steps):
        inputs, labels = batch(step)
        ref_loss = mean_loss(ref(input_ids=inputs).logits, labels)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)

        total = 0.0
        for a in range(args.accum):
            sl = slice(a * per, (a + 1) * per)
            with loss_parallel() if args.loss_parallel else contextlib.nullcontext():
                total += runner.step(inputs[sl], labels[sl]).item()
        loss = total / (args.accum * args.mb)  # the sum over equal microbatches of their means
        if args.tied:
            sum_tied_embedding_grads(stages, group)
        opt.step()
        opt.zero_grad(set_to_none=True)
        rel = abs(loss - ref_loss.item()) / abs(ref_loss.item())
        worst_loss = max(worst_loss, rel)
        if rel > TOL:
            ok = False
        if rank == 0:
            print(f"step {step} loss {loss:.7f} ref {ref_loss.item():.7f} rel {rel:.1e}", flush=True)

    seconds = time.perf_counter() - t0
    # Weights: every local parameter against the reference's; report how far SGD moved them,
    # so the tolerance can be read against the size of the update.
    ref_state = ref.state_dict()  # holds lm_head.weight even when tied
    worst_w, moved, n = 0.0, 0.0, 0
    for stage in stages:
        for name, p in stage.named_parameters():
            w = p.detach().full_tensor() if isinstance(p, DTensor) else p.detach()
            diff = (w - ref_state[name]).abs().max().item()
            moved = max(moved, (ref_state[name] - initial[name]).abs().max().item())
            worst_w, n = max(worst_w, diff), n + 1
            if diff > TOL:
                ok = False
                print(f"[rank{rank}] weight {name} differs by {diff:.2e}", flush=True)
    return {
        "rank": rank,
        "stages": ids,
        "ok": ok,
        "max_loss_rel": worst_loss,
        "max_weight_diff": worst_w,
        "max_update": moved,
        "params": n,
        "steps_s": round(seconds, 2),
    }


def main() -> int:
    """Every ``NAME=ARGS`` case on the command line, in one process group, one after another."""
    cases = [spec.split("=", 1) for spec in sys.argv[1:]]
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    all_ok = True
    for name, argv in cases:
        result = run_case(case_args(shlex.split(argv)))
        all_ok = all_ok and result["ok"]
        print_rank_result({"case": name, **result})
    close_distributed()
    return 0 if all_ok else 1


if __name__ == "__main__":
    exit_rank(main())
