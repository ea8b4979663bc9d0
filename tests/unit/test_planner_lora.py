"""The planner for LoRA (``train.lora``) and with headroom (``launch.memory_fraction``): the issue's
Llama-3.1-8B figures on one trn2.48xlarge, adapter shapes under TP, model states, the activation
model against the autograd graph of Hugging Face's Llama layer, and the CLI and config plumbing.
Pure Python except the autograd check (torch, one process)."""

import json

import pytest

from neuron_parallel.config import DataConfig, JobConfig, LaunchConfig, LoraConfig, ParallelConfig, TrainConfig
from neuron_parallel.planning.hardware import GiB
from neuron_parallel.planning.lora import adapter_numels, lora_stage_params, trainable_parameters
from neuron_parallel.planning.memory import (
    STATES,
    ModelShape,
    job_rank_memory,
    layer_activation_bytes,
    stage_memory,
    stage_params,
)
from neuron_parallel.planning.search import format_table, search_layouts

from .test_planner import LLAMA_8B

TRN2_RANK = 24 * GiB  # AWS: 96 GiB of HBM per Trainium2 chip, 4 logical NeuronCores per chip at LNC=2


@pytest.fixture(scope="module")
def trn2_8b():
    """Llama-3.1-8B, sequence 4096, global batch 64, one trn2.48xlarge (64 ranks), planned once
    each: full fine-tuning, LoRA r=16, and full fine-tuning of rows packed from documents (whose
    attention builds fp32 scores on neuron) with the default headroom and with none."""
    kw = dict(nodes=1, seq_len=4096, global_batch=64)
    return {
        "full": search_layouts(LLAMA_8B, "trn2.48xlarge", **kw),
        "lora": search_layouts(LLAMA_8B, "trn2.48xlarge", lora=LoraConfig(r=16), **kw),
        "packed": search_layouts(LLAMA_8B, "trn2.48xlarge", documents=True, **kw),
        "packed-no-headroom": search_layouts(LLAMA_8B, "trn2.48xlarge", memory_fraction=1.0, documents=True, **kw),
    }


def test_headroom_rejects_the_layout_that_filled_a_trn2_core(trn2_8b):
    # Without headroom the planner picks a layout predicted at 23.8 of the core's 24.0 GiB.
    filled = trn2_8b["packed-no-headroom"].best
    assert (filled.tp, filled.pp, filled.dp, filled.cp, filled.zero_1, filled.sequence_parallel) == (
        16,
        1,
        4,
        1,
        True,
        True,
    )
    assert round(filled.memory_per_rank_bytes / GiB, 1) == 23.8
    # With the default memory_fraction (0.9) the same layout, same prediction, is rejected.
    report = trn2_8b["packed"]
    same = next(c for c in report.candidates if c.describe() == filled.describe())
    assert not same.fits and same.memory_per_rank_bytes == filled.memory_per_rank_bytes
    assert "24.0 GiB, of which a layout may fill 90% (21.60 GiB, memory_fraction=0.9)" in same.reason
    assert "needs 23.79 GiB" in same.reason and "a memory_fraction of at least 1.00" in same.reason
    assert report.feasible and report.best.describe() != filled.describe()
    assert all(c.memory_per_rank_bytes <= 0.9 * TRN2_RANK for c in report.candidates if c.fits)
    assert "fits within 90% of 24.0 GiB = 21.6 GiB per rank" in format_table(report)
    assert report.to_dict()["memory_limit_bytes"] == int(0.9 * TRN2_RANK)


def test_lora_fits_llama_8b_at_a_smaller_tp_than_full_fine_tuning(trn2_8b):
    full, lora = trn2_8b["full"].best, trn2_8b["lora"].best
    assert (full.tp, full.pp, full.cp) == (8, 1, 1) and (lora.tp, lora.pp, lora.cp) == (4, 1, 1)  # the fastest
    assert lora.memory_per_rank_bytes <= 0.9 * TRN2_RANK and lora.tokens_per_s > full.tokens_per_s

    def smallest_tp_without_pipeline(report):
        return min(c.tp for c in report.candidates if c.fits and c.pp == 1)

    assert smallest_tp_without_pipeline(trn2_8b["lora"]) < smallest_tp_without_pipeline(trn2_8b["full"])
    # the engine's bf16 mode (fp32 states and weights, autocast) too
    kw = dict(nodes=1, seq_len=4096, global_batch=64, precision="bf16_autocast", fixed={"pp": 1})
    engine_full = search_layouts(LLAMA_8B, "trn2.48xlarge", **kw)
    engine_lora = search_layouts(LLAMA_8B, "trn2.48xlarge", lora=LoraConfig(r=16), **kw)
    assert smallest_tp_without_pipeline(engine_lora) < smallest_tp_without_pipeline(engine_full)
    assert "LoRA r=16 (7 projections), 41.9M trainable" in format_table(trn2_8b["lora"])


def test_adapters_follow_their_layers_under_tp():
    shape, lora = ModelShape.from_config(LLAMA_8B), LoraConfig(r=16)
    h, i, r, kv = 4096, 14336, 16, 1024
    assert trainable_parameters(shape, lora) == 41_943_040  # peft's count for Llama-3-8B, r=16, all 7
    # (A, B) per projection: column-parallel q/k/v/gate/up keep A whole and split B's rows;
    # row-parallel o/down split A's columns and keep B whole.
    assert adapter_numels(shape, lora, 8) == [
        *(r * h, h // 8 * r),
        *(r * h, kv // 8 * r),
        *(r * h, kv // 8 * r),
        *(r * h // 8, h * r),
        *(r * h, i // 8 * r),
        *(r * h, i // 8 * r),
        *(r * i // 8, h * r),
    ]
    # tp=16 over 8 KV heads: k's and v's B hold the rank's one (replicated) head, like the weight
    assert adapter_numels(shape, lora, 16)[3] == adapter_numels(shape, lora, 16)[5] == 128 * r
    # Only the listed projections; a trained lm_head is one more trainable tensor on the last stage.
    qv = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"])
    trainable, frozen = lora_stage_params(shape, qv, 2, 16, first=False, last=True)
    assert trainable[-1] == (128256 // 2 * h, True) and len(trainable) == 16 * 4 + 1
    assert frozen + trainable[-1][0] == sum(n for n, _ in stage_params(shape, 2, 16, False, True))
    # Tied embeddings: one weight, trained when either name is listed.
    tied = ModelShape.from_config(dict(LLAMA_8B, tie_word_embeddings=True))
    trainable, _ = lora_stage_params(tied, LoraConfig(modules_to_save=["lm_head"]), 1, 32, first=True, last=True)
    assert [n for n, _ in trainable].count(128256 * h) == 1


def test_lora_states_are_a_frozen_base_and_small_trainable_tensors():
    shape, lora = ModelShape.from_config(LLAMA_8B), LoraConfig(r=16)
    kw = dict(tp=8, pp=1, sp=True, recompute=0, micro_batch=1, seq_len=4096, num_microbatches=1, schedule="1f1b")
    kw.update(virtual_stages=1, precision="bf16_autocast", pp_rank=0, layers=[32], dp=8)
    trainable = sum(adapter_numels(shape, lora, 8)) * 32
    full = stage_memory(shape, zero_1=False, grad_accum=2, **kw)
    plain = stage_memory(shape, zero_1=False, grad_accum=2, lora=lora, **kw)
    zero = stage_memory(shape, zero_1=True, grad_accum=2, lora=lora, **kw)
    assert plain.numel == full.numel + trainable and plain.trainable_numel == trainable
    # fp32 frozen base (no autocast cache: torch caches only weights that require grad);
    # fp32 adapters with their cached bf16 copies, fp32 grads, AdamW's two fp32 moments
    assert plain.params == full.numel * 4 + trainable * (4 + 2)
    assert plain.grads == trainable * 4 and plain.optimizer == trainable * 8
    # ZeRO-1 shards only the adapters' optimizer state
    assert zero.params == plain.params and trainable <= zero.optimizer < 1.05 * trainable
    assert plain.grads + plain.optimizer < 0.02 * (full.grads + full.optimizer) and plain.total < full.total
    # A trained lm_head has its gradient at the start of the layers' backward.
    head = stage_memory(shape, zero_1=False, grad_accum=1, lora=LoraConfig(r=16, modules_to_save=["lm_head"]), **kw)
    assert head.phase == "backward" and head.grads == 128256 // 8 * 4096 * 4


# Decoder layer of the bench's "small" shape, read off the autograd graph below.
SMALL = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=4)


def _saved_bytes_per_token(lora: LoraConfig | None, autocast: bool, b: int = 2, s: int = 64) -> float:
    """Bytes per token one Hugging Face Llama decoder layer saves for backward, its base frozen
    and the targets given adapters computed as ``neuron_parallel.parallel.lora.LoRALinear`` does
    (``F.linear(x, W) + s · F.linear(F.linear(x, A), B)``); parameters, their bf16 copies, the
    rotary tables and RMSNorm's ``(b, s, 1)`` statistics left out, as the planner leaves them."""
    import torch
    import torch.nn.functional as F
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    class Adapted(torch.nn.Module):
        def __init__(self, base, r):
            super().__init__()
            self.base = base
            self.A = torch.nn.Parameter(torch.randn(r, base.in_features) / 16)
            self.B = torch.nn.Parameter(torch.randn(base.out_features, r) / 16)

        def forward(self, x):
            return self.base(x) + F.linear(F.linear(x, self.A), self.B) * 2.0

    config = LlamaConfig(**SMALL, vocab_size=1000)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    layer, rotary = LlamaDecoderLayer(config, 0), LlamaRotaryEmbedding(config)
    if lora is not None:
        layer.requires_grad_(False)
        for block in (layer.self_attn, layer.mlp):
            for name in lora.target_modules:
                if hasattr(block, name):
                    setattr(block, name, Adapted(getattr(block, name), lora.r))
    x = torch.randn(b, s, SMALL["hidden_size"], requires_grad=True)
    positions = torch.arange(s).expand(b, s)
    cos, sin = rotary(x, positions)
    skip = {t.untyped_storage().data_ptr() for t in (*layer.parameters(), cos, sin)}
    saved = {}

    def pack(t):
        weight_copy = t.dim() == 2 and t.shape[0] != b * s
        if t.untyped_storage().data_ptr() not in skip and not weight_copy and t.shape[-1] != 1:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            layer(x, attention_mask=None, position_ids=positions, position_embeddings=(cos, sin))
    return sum(saved.values()) / (b * s)


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize(
    "lora",
    [None, LoraConfig(r=8), LoraConfig(r=4, target_modules=["q_proj", "v_proj"])],
    ids=["full", "lora-all", "lora-qv"],
)
def test_lora_activations_match_the_autograd_graph(lora, autocast):
    shape = ModelShape.from_config(dict(SMALL, vocab_size=1000))
    st = STATES["bf16_autocast" if autocast else "fp32"]
    predicted = sum(layer_activation_bytes(shape, 1, False, st, lora).values())
    assert predicted == _saved_bytes_per_token(lora, autocast)


def test_memory_fraction_is_checked():
    assert LaunchConfig(memory_fraction=1.0).memory_fraction == 1.0 and LaunchConfig().memory_fraction == 0.9
    for bad in (0, -0.5, 1.2, float("nan")):
        with pytest.raises(ValueError, match=r"launch.memory_fraction must lie in \(0, 1\].*e.g. 0.9"):
            LaunchConfig(memory_fraction=bad)
    with pytest.raises(ValueError, match=r"memory_fraction must lie in \(0, 1\]"):
        search_layouts(LLAMA_8B, "trn2.48xlarge", seq_len=4096, global_batch=64, memory_fraction=1.5)


def test_cli_plans_lora_with_headroom(tmp_path, capsys):
    from neuron_flows.flows.cli import main

    args = ["plan", "--model", json.dumps(LLAMA_8B), "--hardware", "trn2", "--seq-len", "4096", "--global-batch", "64"]
    assert main([*args, "--lora-r", "16", "--memory-fraction", "0.8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["lora"]["r"] == 16 and out["trainable_parameters"] == 41_943_040
    assert out["memory_fraction"] == 0.8 and out["memory_limit_bytes"] == int(0.8 * TRN2_RANK)
    fitting = [c for c in out["candidates"] if c["fits"]]
    assert fitting and all(c["memory_per_rank_bytes"] <= out["memory_limit_bytes"] for c in fitting)
    assert main([*args, "--lora-r", "8", "--lora-targets", "q_proj,v_proj", "--top", "2"]) == 0
    table = capsys.readouterr().out
    assert "LoRA r=8 (q_proj, v_proj)" in table and "fits within 90% of 24.0 GiB = 21.6 GiB" in table
    assert main([*args, "--lora-targets", "q_proj"]) == 2
    assert "--lora-targets needs --lora-r" in capsys.readouterr().err
    assert main([*args, "--lora-r", "8", "--lora-targets", "qproj"]) == 2
    assert main([*args, "--memory-fraction", "0"]) == 2


def test_config_plans_for_its_lora_and_memory_fraction(tiny_world):
    from neuron_flows.tasks import steps
    from neuron_flows.tasks.config import FinetuneConfig

    config = FinetuneConfig.load(
        None,
        [
            f"model.name_or_path={tiny_world['model']}",
            "launch.nproc_per_node=4",
            "data.block_size=32",
            "train.global_batch_size=8",
            "train.lora={r: 4, target_modules: [q_proj, v_proj]}",
            "launch.memory_fraction=0.5",
        ],
    )
    layout, report = steps.plan(config, tiny_world["model"])
    assert report.lora == LoraConfig(r=4, target_modules=["q_proj", "v_proj"]) and report.memory_fraction == 0.5
    assert layout.predicted_memory_bytes == report.best.memory_per_rank_bytes
    # The engine-side prediction reads the job's train.lora.
    shape = ModelShape.from_config(tiny_world["model"])
    job = JobConfig(
        model_path=tiny_world["model"],
        dataset_path="",
        output_dir="",
        data=DataConfig(block_size=32),
        parallel=ParallelConfig(),
        train=TrainConfig(micro_batch_size=4, global_batch_size=4, lora=LoraConfig(r=4)),
    )
    mem = job_rank_memory(shape, job, 0)
    assert mem.trainable_numel == sum(adapter_numels(shape, LoraConfig(r=4), 1)) * shape.num_layers
