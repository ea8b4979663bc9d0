"""Tensor-parallel parity check, one torchrun job: TP(+SP) training equals one process.

    run_ranks("tests/dist/dist_tp_check.py", N, ["NAME=ARGS", ...])   (neuron_parallel.testing.ranks)

where each ARGS is ``[--model llama|qwen3] [--heads 4] [--kv-heads 2] [--no-sp]
[--no-loss-parallel] [--tied] [--bias] [--compile] [--loss-chunk N]``: the cases run one after
another in one launch. ``--compile`` compiles the sharded decoder layers as ``train.compile`` does
(``neuron_parallel.engine.compile_layers``: inductor on CPU). ``--loss-chunk N`` takes the loss
as the engine does (``CausalLMStage.loss``: the stage returns the final norm's output), in
chunks of N tokens.

Every rank builds a tiny model on the meta device, shards it over a 1-D tp mesh of the world,
materialises it and loads the weights of a seeded reference model (saved once as a Hugging
Face directory). It trains 3 AdamW steps (fp32) and checks, on rank 0, against that Hugging
Face model trained in one process on the same batches: losses per step (relative 1e-5), step-0
gradients both gathered (``full_tensor``) and as each rank's local shard after
``align_grad_placements`` (what dp all-reduce and clipping read), that checkpoint ownership
(``_owns``) stores every element of every parameter exactly once, and (with SP) that a sequence
length tp does not divide is refused. Every rank prints one result line per case
(``print_rank_result``; rank 0's carries the measurements); exits non-zero on any mismatch.
"""

from __future__ import annotations

import argparse
import contextlib
import shlex
import shutil
import sys
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from neuron_parallel.checkpoint.save import _owns
from neuron_parallel.checkpoint.tensors import HFWeights
from neuron_parallel.engine import compile_layers
from neuron_parallel.mesh import close_distributed, exit_rank
from neuron_parallel.models.causal_lm import CausalLMStage, build_meta_model, causal_lm_loss, load_weights, materialize
from neuron_parallel.parallel.dtensor import local_view
from neuron_parallel.parallel.tensor import align_grad_placements, apply_tensor_parallel
from neuron_parallel.testing.ranks import print_rank_result

BATCH, SEQ, STEPS, LR, TOL = 4, 16, 3, 1e-2, 1e-5
PAD = 200  # a padding_idx in the second half of the vocab: its row lives off rank 0


def make_config(args):
    from transformers import LlamaConfig, Qwen3Config

    cls = Qwen3Config if args.model == "qwen3" else LlamaConfig
    extra = {"head_dim": 16} if args.model == "qwen3" else {}
    return cls(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        intermediate_size=128,
        vocab_size=256,
        max_position_embeddings=64,
        tie_word_embeddings=args.tied,
        pad_token_id=PAD,
        attention_bias=args.bias,
        rms_norm_eps=1e-6,
        **extra,
    )


def write_reference(config, out_dir: str) -> None:
    """A seeded model saved as a Hugging Face directory. Norm weights and biases are randomised
    too (HF initialises them to constants), so a wrongly sliced or unsynchronised one shows."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(out_dir)


def reference_model(model_dir: str):
    """The single-process reference: the Hugging Face model itself, loaded from the directory
    (tied embeddings stay tied, as Hugging Face trains them)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    return _Logits(model).train()


class _Logits(torch.nn.Module):
    """``input_ids → logits`` with the Hugging Face parameter names (``model.*``, ``lm_head.*``)."""

    def __init__(self, hf):
        super().__init__()
        self.model, self.lm_head = hf.model, hf.lm_head

    def forward(self, input_ids):
        return self.lm_head(self.model(input_ids=input_ids).last_hidden_state)


def tp_stage(config, model_dir: str, tp_mesh, *, sp: bool, lp: bool, compile: bool = False) -> CausalLMStage:
    """The project's real path: meta model → stage → TP → materialize → load_weights (→ compile)."""
    full = build_meta_model(config)
    stage = CausalLMStage(full, range(config.num_hidden_layers), first=True, last=True)
    apply_tensor_parallel(stage, tp_mesh, sequence_parallel=sp, loss_parallel=lp)
    materialize(stage, torch.device("cpu"))
    load_weights(stage, HFWeights(model_dir), tied=config.tie_word_embeddings)
    if compile:
        compile_layers([stage], torch.device("cpu"))
    return stage.train()


def batch(step: int, vocab: int):
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=g)
    tokens[:, ::5] = PAD  # padding_idx rows get no gradient: check the sharded lookup keeps that
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def train(stage, vocab, *, lp=False):
    """3 AdamW steps; returns (losses, step-0 grads: name → (full grad, local grad, offsets))."""
    opt = torch.optim.AdamW(stage.parameters(), lr=LR, weight_decay=0.01, foreach=False)
    losses, grads0 = [], {}
    for step in range(STEPS):
        inputs, labels = batch(step, vocab)
        with loss_parallel() if lp else contextlib.nullcontext():
            engine_loss = not getattr(stage, "return_logits", True)  # the chunked loss of the engine
            loss = stage.loss(stage(inputs), labels) if engine_loss else causal_lm_loss(stage(inputs), labels)
            loss = loss / labels.numel()
            loss.backward()
        align_grad_placements(stage.parameters())
        if step == 0:
            for name, p in stage.named_parameters():
                g = p.grad
                full = g.full_tensor() if isinstance(g, DTensor) else g
                local, _, offsets = local_view(g)
                grads0[name] = (full.detach().clone(), local.detach().clone(), offsets)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append((loss.full_tensor() if isinstance(loss, DTensor) else loss).item())
    return losses, grads0


def ownership_ok(stage) -> list[str]:
    """Names of parameters whose stored pieces (rank by rank, as save.py decides) do not cover
    the global tensor exactly once."""
    mine = {
        n: (local_view(p)[2], list(p.to_local().shape) if isinstance(p, DTensor) else list(p.shape))
        for n, p in stage.named_parameters()
        if _owns(p.detach(), dist.get_rank())
    }
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    bad = []
    for name, p in stage.named_parameters():
        cover = torch.zeros(p.shape, dtype=torch.int32)
        for pieces in everyone:
            if name in pieces:
                off, shape = pieces[name]
                cover[tuple(slice(o, o + n) for o, n in zip(off, shape))] += 1
        if not bool((cover == 1).all()):
            bad.append(name)
    return bad


def case_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=["llama", "qwen3"], default="llama")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--no-sp", action="store_true")
    ap.add_argument("--no-loss-parallel", action="store_true")
    ap.add_argument("--tied", action="store_true")
    ap.add_argument("--bias", action="store_true", help="attention_bias=True (q/k/v/o biases)")
    ap.add_argument("--compile", action="store_true", help="compile the decoder layers (train.compile)")
    ap.add_argument("--loss-chunk", type=int, default=0, help="the engine's loss in chunks of N tokens")
    return ap.parse_args(argv)


def run_case(args: argparse.Namespace, mesh) -> tuple[dict | None, bool]:
    """One parity case on the whole world; returns (result on rank 0 else None, ok)."""
    sp, lp = not args.no_sp, not args.no_loss_parallel
    rank, world = dist.get_rank(), dist.get_world_size()
    config = make_config(args)

    holder = [tempfile.mkdtemp(prefix="tpcheck-") if rank == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    model_dir = holder[0]
    if rank == 0:
        write_reference(config, model_dir)
        ref_losses, ref_grads = train(reference_model(model_dir), config.vocab_size)
    dist.barrier()

    stage = tp_stage(config, model_dir, mesh, sp=sp, lp=lp, compile=args.compile)
    if args.loss_chunk:
        stage.return_logits = False
        stage.loss_chunk_bytes = 4 * local_view(stage.lm_head.weight)[0].shape[0] * args.loss_chunk
    dist.barrier()  # every rank has loaded its slices: the directory can go
    if rank == 0:
        shutil.rmtree(model_dir, ignore_errors=True)
    k = stage.model.layers["0"].self_attn.k_proj.weight
    kv_local = {"shape": list(k.to_local().shape), "offset": local_view(k)[2], "mesh": list(k.device_mesh.shape)}
    bad_owners = ownership_ok(stage)
    losses, grads = train(stage, config.vocab_size, lp=lp)
    seq_len_refused = None
    if sp:  # a sequence that does not split over tp is refused up front, before any collective
        try:
            stage(batch(0, config.vocab_size)[0][:, :-1])
            seq_len_refused = False
        except ValueError as e:
            seq_len_refused = "not divisible" in str(e)
    kv_all = [None] * world
    dist.all_gather_object(kv_all, kv_local)
    # Each rank's local step-0 grad shards, to compare with the matching reference slices.
    gathered = [None] * world
    dist.all_gather_object(gathered, {name: (offsets, local) for name, (_, local, offsets) in grads.items()})
    if rank != 0:
        return None, True

    rel = [abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)]
    unmatched = sorted(set(grads) ^ set(ref_grads))  # e.g. a tie that one side lost
    full_diff = {n: (grads[n][0] - ref_grads[n][0]).abs().max().item() for n in ref_grads if n in grads}
    local_diff = 0.0
    for per_rank in gathered:
        for name, (offsets, local) in per_rank.items():
            if name not in ref_grads:
                continue
            ref = ref_grads[name][0][tuple(slice(o, o + n) for o, n in zip(offsets, local.shape))]
            local_diff = max(local_diff, (local - ref).abs().max().item())
    worst = max(full_diff, key=full_diff.get)
    result = {
        "tp": world,
        "model": args.model,
        "sp": sp,
        "loss_parallel": lp,
        "tied": args.tied,
        "bias": args.bias,
        "compile": args.compile,
        "loss_chunk": args.loss_chunk,
        "losses": losses,
        "ref_losses": ref_losses,
        "max_rel_loss_diff": max(rel),
        "max_grad_diff": full_diff[worst],
        "worst_grad": worst,
        "max_local_grad_diff": local_diff,
        "n_params": len(full_diff),
        "kv_heads": args.kv_heads,
        "head_dim": 16,
        "k_proj_per_rank": kv_all,
        "sp_seq_len_refused": seq_len_refused,
        "bad_ownership": bad_owners,
        "unmatched_params": unmatched,
    }
    ok = max(rel) <= TOL and full_diff[worst] <= TOL and local_diff <= TOL and not bad_owners and not unmatched
    return result, ok and seq_len_refused is not False


def main() -> int:
    """Every ``NAME=ARGS`` case on the command line, in one process group, one after another."""
    cases = [spec.split("=", 1) for spec in sys.argv[1:]]
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    all_ok = True
    for name, argv in cases:
        result, ok = run_case(case_args(shlex.split(argv)), mesh)
        all_ok = all_ok and ok
        print_rank_result({"rank": rank, "case": name, "ok": ok, **(result or {})})
    close_distributed()
    return 0 if all_ok else 1


if __name__ == "__main__":
    exit_rank(main())
