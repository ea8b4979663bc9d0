"""Context parallelism in the planner: ``parallel.cp`` is searched like tp and pp (or pinned), a cp
layout's memory per rank is that of its ``S/cp`` tokens of every row plus what attention across
the shards holds (off CUDA, the blocked attention's one block of queries at a time), its step
time adds the K/V exchange on the cp group's links and the blocked attention's recompute, every
collective pays its latency, and a cp the rows or the world cannot take is refused when the
config is read. Pure Python (no torch, no processes); the measured side is
tests/dist/test_context_memory.py (memory per rank), tests/unit/test_planner_attention.py (the
blocked attention's backward) and the ``dp2-cp2`` layout of tests/dist/test_comm.py (bytes of the
K/V exchange)."""

import dataclasses
import json

import pytest

from neuron_parallel.planning.attention import blocked_work
from neuron_parallel.planning.hardware import GiB, get_hardware
from neuron_parallel.planning.layout import describe_layout
from neuron_parallel.planning.memory import STATES, ModelShape, stage_memory
from neuron_parallel.planning.search import MIN_CONTEXT_CHUNK, format_table, search_layouts
from neuron_parallel.planning.timing import collective_latency, kv_exchange_bytes, links, scores_seconds
from neuron_parallel.utils import CONTEXT_QUERY_BLOCK

from .test_planner import LLAMA_8B


@pytest.fixture(scope="module")
def trn2():
    """Llama-3.1-8B on one trn2.48xlarge, as ``neuron-flows plan`` plans it by default (bf16, a
    global batch of 64 rows), at 4096 and 65536 tokens."""
    return {seq: search_layouts(LLAMA_8B, "trn2.48xlarge", seq_len=seq, global_batch=64) for seq in (4096, 65536)}


def test_short_rows_keep_cp1_on_trn2(trn2):
    """At 4096 tokens cp > 1 layouts are searched and some fit, but none is fastest: on neuron
    every cp layout attends through a mask, off the flash kernel, a block of queries at a time
    whose fp32 scores go through HBM and are recomputed in backward."""
    report = trn2[4096]
    cps = {c.cp for c in report.candidates if c.valid}
    assert cps == {1, 2, 4}  # 4096 / (2·cp) >= MIN_CONTEXT_CHUNK
    assert any(c.fits for c in report.candidates if c.cp > 1)
    assert report.best.cp == 1 and report.best.memory_per_rank_bytes <= report.memory_limit
    autocast = search_layouts(LLAMA_8B, "trn2.48xlarge", seq_len=4096, global_batch=64, precision="bf16_autocast")
    assert autocast.best.cp == 1  # what the plan step runs on neuron


def test_long_rows_on_trn2_fit_with_cp_layouts_among_the_candidates(trn2):
    """At 65536 tokens every cp from 2 to 64 is a candidate with its memory and step time, the best
    layout fits within memory_fraction, and cp layouts fit too: on neuron a cp layout's attention
    runs CONTEXT_QUERY_BLOCK queries at a time, so a layer's backward holds the fp32 scores of one
    block, (heads/tp)·512·S per row, not of (heads/tp)·(S/cp)·S. The best is cp = 1 all the same:
    its rows need no mask and run torch-neuronx's flash kernel, where every cp layout writes its
    scores through HBM (and backward recomputes each block's)."""
    report = trn2[65536]
    best = report.best
    assert best.fits and best.memory_per_rank_bytes <= report.memory_limit
    cp_layouts = [c for c in report.candidates if c.cp > 1 and c.valid]
    assert {c.cp for c in cp_layouts} == {2, 4, 8, 16, 32, 64}
    assert all(c.memory_per_rank_bytes and c.tokens_per_s and c.time["cp_comm_s"] > 0 for c in cp_layouts)
    fitting = [c for c in cp_layouts if c.fits]
    assert {2, 4, 8, 16} <= {c.cp for c in fitting}
    assert all(c.memory_per_rank_bytes <= report.memory_limit for c in fitting)
    assert best.cp == 1 and best.tokens_per_s > max(c.tokens_per_s for c in fitting)


def test_a_blocked_layer_holds_one_block_of_scores():
    """Off CUDA a cp layer's backward holds, per row: three fp32 (heads/tp)·B·S score-sized
    tensors of one block (B = CONTEXT_QUERY_BLOCK), three of the four repeated K/V and their
    gradients (the decomposition's), the gathered K/V's accumulated gradients and two query
    gradients, whatever cp: at 65536 tokens and tp 8 under 1.8 GiB, where the whole
    (heads/tp)·(S/cp)·S scores of cp = 2 would be 32 GiB each."""
    shape, st = ModelShape.from_config(LLAMA_8B), STATES["bf16"]
    seq, tp, heads, kv, d = 65536, 8, 4, 1, 128  # local heads and KV heads at tp 8
    for cp in (2, 8, 64):
        held = seq // cp * blocked_work(shape, tp, seq, st, "score_blocks", cp, documents=False)
        scores = 3 * heads * CONTEXT_QUERY_BLOCK * seq * 4
        rest = 3 * seq * heads * d * 2 + 2 * seq * kv * d * 2 + 2 * seq // cp * heads * d * 2
        assert held == pytest.approx(scores + rest, rel=1e-12) and held < 1.8 * GiB
    assert heads * seq // 2 * seq * 4 == 32 * GiB


def test_a_blocked_layer_recomputes_its_attention_forward():
    """Off CUDA a cp layout's backward recomputes every layer's attention forward: its 4·H·Q·S
    FLOPs per token once more, and on neuron the forward's 6 passes over the fp32 scores once
    more, whose bytes summed over the blocks are those of the whole (heads/tp)·(S/cp)·S."""
    shape, hw, seq = ModelShape.from_config(LLAMA_8B), get_hardware("trn2.48xlarge"), 65536
    layout = dict(tp=8, pp=1, cp=2, activation_checkpointing=0, micro_batch_size=1, sequence_parallel=True)
    (c,) = search_layouts(LLAMA_8B, hw, seq_len=seq, global_batch=64, fixed=dict(layout, zero_1=True)).candidates
    tokens, rate = seq // 2, hw.peak_flops("bf16") * hw.efficiency
    f_attn = 4 * shape.num_heads * shape.head_dim * seq
    flops = 3 * (2 * shape.layer_params + f_attn) * 32 + 3 * 2 * shape.vocab_size * shape.hidden_size
    passes = (6 + 7 + 6) * 32 * scores_seconds(shape, hw, 8, 2, 1, seq)
    per_microbatch = tokens * (flops + f_attn * 32) / 8 / rate + passes
    assert c.time["compute_s"] == pytest.approx(c.grad_accum * per_microbatch, rel=1e-12)


def test_every_collective_pays_its_latency():
    """NCCL's ring model (8.4 µs a call, 3.4 µs a step within a node, 14 µs a step across nodes),
    on every collective the step time counts: tp's all-gathers and reduce-scatters (SP), cp's
    all-gathers and reduce-scatters of K and of V, the pipeline's sends, the dp × cp gradient
    all-reduce (one call per bucket) and ZeRO-1's broadcasts (one per owner)."""
    trn2 = get_hardware("trn2.48xlarge")
    us = 1e-6
    assert [trn2.call_latency, trn2.link_latency, trn2.network_latency] == pytest.approx([8.4 * us, 3.4 * us, 14 * us])
    assert collective_latency(trn2, 1, 64) == 0.0
    assert collective_latency(trn2, 8, 128) == pytest.approx((8.4 + 6 * 3.4 + 14) * us)  # 8 ranks over 2 nodes
    assert collective_latency(trn2, 4, 4, passes=2) == pytest.approx((8.4 + 2 * 3 * 3.4) * us)  # an all-reduce
    none = dataclasses.replace(trn2, call_latency=0.0, link_latency=0.0, network_latency=0.0)
    fixed = dict(tp=4, pp=2, cp=2, zero_1=True, sequence_parallel=True, activation_checkpointing=1)
    fixed.update(pipeline_schedule="1f1b", num_microbatches=2, micro_batch_size=2)
    kw = dict(seq_len=8192, global_batch=64, fixed=fixed)
    (c,) = search_layouts(LLAMA_8B, trn2, **kw).candidates
    (c0,) = search_layouts(LLAMA_8B, none, **kw).candidates
    passes = c.grad_accum * c.num_microbatches
    diff = {k: c.time[k] - c0.time[k] for k in c.time}
    # the worst stage (the last): 16 layers, each recomputed, and the lm_head: 16·4 + 16·2 + 2
    assert diff["tp_comm_s"] == pytest.approx(passes * 98 * 2 * (8.4 + 3 * 3.4) * us)
    assert diff["cp_comm_s"] == pytest.approx(passes * (2 * 16 + 16) * 2 * (8.4 + 3.4) * us)
    assert diff["pp_p2p_s"] == pytest.approx(passes * 2 * (8.4 + 3.4) * us)
    buckets = -(-c.memory["trainable_numel"] * 2 // (32 << 20))
    assert diff["dp_comm_s"] == pytest.approx((buckets * (8.4 + 2 * 7 * 3.4) + 8 * (8.4 + 7 * 3.4)) * us)


def test_long_rows_on_gpus_fit_with_cp(tmp_path, capsys):
    """Where attention takes a block mask (FlexAttention on CUDA), cp splits a 65536-token row and
    fits: ``plan --json`` gives every candidate's cp, and the table prints cp=N."""
    from neuron_flows.flows.cli import main

    args = ["plan", "--model", json.dumps(LLAMA_8B), "--hardware", "p5.48xlarge", "--seq-len", "65536"]
    args += ["--global-batch", "64"]
    assert main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert all("cp" in c for c in out["candidates"])
    fitting = [c for c in out["candidates"] if c["fits"]]
    assert fitting and fitting[0]["memory_per_rank_bytes"] <= out["memory_limit_bytes"]
    assert any(c["cp"] >= 2 for c in fitting)
    assert main(args) == 0
    table = capsys.readouterr().out
    assert " cp=" in table and "feasible: True" in table


def test_a_cp_layout_holds_its_share_of_the_tokens():
    """Against cp = 1 with the same tokens per rank (cp times fewer rows), a cp2 rank holds the
    same activations plus the whole row's K/V (FlexAttention keeps the grouped heads as they are,
    for the local ones) and its ZeRO-1 share is over dp × cp; its K/V exchange is the all-gather
    and the reduce-scatter of 2·b·S·kv·d elements per layer."""
    shape = ModelShape.from_config(LLAMA_8B)
    kw = dict(tp=1, pp=1, zero_1=True, sp=False, recompute=0, seq_len=65536, num_microbatches=1, grad_accum=1)
    kw.update(schedule="1f1b", virtual_stages=1, precision="bf16", pp_rank=0, layers=[32], device="cuda")
    whole = stage_memory(shape, dp=8, micro_batch=1, **kw)
    shard = stage_memory(shape, dp=4, cp=2, micro_batch=2, **kw)  # 2 rows of which it holds 32768 tokens each
    assert shard.optimizer == whole.optimizer and shard.params == whole.params
    kv = 8 * 128 * 2  # KV heads × head_dim × bf16 bytes per token, K and V each
    assert shard.activations - whole.activations == pytest.approx(32 * 65536 * 2 * kv + 65536 * (8 + 16), rel=1e-9)
    assert kv_exchange_bytes(shape, 1, 2, 65536, 2) == 2 * 2 * 65536 * kv


def test_cp_links_follow_the_mesh():
    """The mesh is (dp, cp, pp, tp): a cp group spans cp·pp·tp consecutive ranks, on the node's
    links while that fits in a node, else on the network, one ring per (pp, tp) coordinate."""
    trn2 = get_hardware("trn2.48xlarge")
    assert links(trn2, tp=8, pp=2, dp=1, cp=4)["cp"] == trn2.intra_node_bw
    across = links(trn2, tp=8, pp=2, dp=1, cp=8)["cp"]  # 128 ranks: two nodes
    assert across == trn2.inter_node_bw / 16 < trn2.intra_node_bw
    assert links(trn2, tp=8, pp=1, dp=8, cp=2)["dp"] == trn2.inter_node_bw / 8  # dp × cp reduce across nodes


def test_pinned_cp_is_kept_and_printed():
    """A pinned cp is the only one searched, even with chunks shorter than MIN_CONTEXT_CHUNK."""
    fixed = {"cp": 4, "tp": 8, "pp": 1}
    report = search_layouts(LLAMA_8B, "trn2.48xlarge", seq_len=1024, global_batch=64, fixed=fixed)
    assert 1024 // 8 < MIN_CONTEXT_CHUNK and {c.cp for c in report.candidates} == {4}
    best = report.best
    assert best.dp == 2 and best.describe().startswith("tp=8 pp=1 dp=2 cp=4") and "cp=4" in format_table(report)
    assert describe_layout(best.to_parallel_config()).startswith("tp=8 pp=1 dp=2 cp=4")
    assert best.to_parallel_config().cp == 4 and best.to_parallel_config().world_size == 64


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["parallel.cp=3"], r"parallel.cp=3 does not divide the world size 4 .*use parallel.cp in \[1, 2, 4\]"),
        (
            ["parallel.cp=4", "data.block_size=100"],
            r"data.block_size=100 does not split over parallel.cp=4: .* 2·cp = 8 equal chunks; use a "
            r"data.block_size that is a multiple of 8 \(e.g. 104\), or parallel.cp in \[1, 2, 5, 10, 25, 50\]",
        ),
        (
            ["launch.nproc_per_node=8", "parallel.cp=2", "parallel.tp=4", "parallel.sequence_parallel=true"]
            + ["data.block_size=36"],
            r"data.block_size=36 does not split over parallel.cp=2: .*split over tp=4 .*multiple of 8 \(e.g. 40\)",
        ),
    ],
)
def test_a_cp_the_world_or_the_rows_cannot_take_is_refused_when_read(overrides, match):
    from neuron_flows.tasks.config import FinetuneConfig

    with pytest.raises(ValueError, match=match):
        FinetuneConfig.load(None, ["launch.nproc_per_node=4", *overrides])
    assert FinetuneConfig.load(None, ["launch.nproc_per_node=4", "data.block_size=100"]).pinned() == {}  # cp auto


def test_check_layout_refuses_rows_cp_cannot_cut(tiny_world):
    from neuron_parallel.config import DataConfig, JobConfig, ParallelConfig, TrainConfig
    from neuron_parallel.planning.layout import check_layout

    def job(block: int, world: int = 4, **parallel) -> JobConfig:
        pc = ParallelConfig.for_world(world, **parallel)
        train = TrainConfig(micro_batch_size=2, global_batch_size=2 * pc.dp)
        data = DataConfig(block_size=block)
        return JobConfig(
            model_path=tiny_world["model"], dataset_path="", output_dir="", data=data, parallel=pc, train=train
        )

    assert check_layout(job(64, cp=4)).parallel.cp == 4
    with pytest.raises(ValueError, match=r"data.block_size=36 does not split over parallel.cp=4"):
        check_layout(job(36, cp=4))
    with pytest.raises(ValueError, match=r"split over tp=4 \(sequence parallelism\); .*multiple of 8"):
        check_layout(job(36, 8, cp=2, tp=4, sequence_parallel=True))


def test_neuron_under_cp_is_told_it_leaves_the_flash_kernel():
    from neuron_parallel.planning.attention import attention_path, block_size_advice

    assert (
        attention_path("neuron", False, 65536, 128) == "flash"
        and block_size_advice("neuron", False, 65536, 128) is None
    )
    assert attention_path("neuron", False, 65536, 128, cp=2) == "score_blocks"
    advice = block_size_advice("neuron", False, 65536, 128, cp=2)
    assert "parallel.cp=2" in advice and f"up to {CONTEXT_QUERY_BLOCK} queries at a time" in advice
    assert (
        attention_path("cuda", False, 65536, 128, cp=2) == "flex"
        and block_size_advice("cuda", False, 65536, 128, 2) is None
    )
    assert attention_path("cpu", False, 65536, 128, cp=2) == "mask_blocks"
