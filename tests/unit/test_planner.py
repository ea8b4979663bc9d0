"""The planner: hardware catalog, memory model and ranked layouts, against published figures (the
ZeRO paper, AWS's Trainium specifications) and published configurations. Pure Python (no torch,
no processes) except the check_plan round trip, which reads the tiny model's config. Memory
calibration against real runs is bench/planner.py."""

import json

import pytest

from neuron_parallel.planning.hardware import GiB, get_hardware, hardware_names, load_hardware
from neuron_parallel.planning.memory import ModelShape, max_bucket, model_states_bytes, stage_memory, zero_partition
from neuron_parallel.planning.search import search_layouts

from ..conftest import PINNED_LAYOUT

# Public shapes (Hugging Face config.json of meta-llama/Llama-3.1-8B and -70B).
LLAMA_8B = dict(
    model_type="llama",
    hidden_size=4096,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    intermediate_size=14336,
    vocab_size=128256,
    tie_word_embeddings=False,
)
LLAMA_70B = dict(LLAMA_8B, hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, intermediate_size=28672)


@pytest.fixture(scope="module")
def plans_trn1():
    """The three trn1 reports, planned once (about a second each)."""
    kw = dict(seq_len=8192, global_batch=1024)
    return {
        "8b-32": search_layouts(LLAMA_8B, "trn1.32xlarge", nodes=32, **kw),
        "70b-1": search_layouts(LLAMA_70B, "trn1.32xlarge", nodes=1, **kw),
        "70b-32": search_layouts(LLAMA_70B, "trn1.32xlarge", nodes=32, **kw),
    }


def _published(report, tp, pp, dp):
    return [
        c
        for c in report.candidates
        if c.valid
        and (c.tp, c.pp, c.dp) == (tp, pp, dp)
        and c.zero_1
        and c.sequence_parallel
        and c.activation_checkpointing
        and c.pipeline_schedule == "1f1b"
    ]


def test_zero_paper_test_vector():
    # The ZeRO paper (Rajbhandari et al. 2020), figure 1: Ψ = 7.5e9, dp = 64 → 120 GB plain, 31.4 GB
    # with ZeRO-1 (4Ψ + 12Ψ/dp).
    assert model_states_bytes(7.5e9, dp=64, zero_1=False, precision="bf16") == 120e9
    assert round(model_states_bytes(7.5e9, dp=64, zero_1=True, precision="bf16") / 1e9, 1) == 31.4
    # The engine's fp32 mode: 16 bytes/param, ZeRO-1 shards the 8 bytes of Adam moments.
    assert model_states_bytes(1e9, dp=8, zero_1=True, precision="fp32") == 8e9 + 1e9


def test_model_shape_counts_parameters_like_check_layout(tmp_path):

    (tmp_path / "config.json").write_text(json.dumps(LLAMA_8B))
    for source in (LLAMA_8B, tmp_path, tmp_path / "config.json", str(tmp_path)):
        shape = ModelShape.from_config(source)
        assert shape.num_parameters == 8_030_261_248
    assert ModelShape.from_config(LLAMA_70B).num_parameters == 70_553_706_496
    with pytest.raises(ValueError, match="lacks"):
        ModelShape.from_config({"hidden_size": 8})


def test_zero_partition_replays_zero_redundancy_optimizer():
    # Matrices first, largest first onto the least-loaded rank; then vectors.
    sizes = ((100, True), (60, True), (50, True), (10, False), (10, False))
    # 100 → r0, 60 → r1, 50 → r1 (110), 10 → r0 (110), 10 → r0 on the tie (lowest index)
    assert zero_partition(sizes, 2) == ((120, 100), (110, 60))
    # One flat bucket at a time beyond the grads while the dp all-reduce walks them: [10], [20, 5].
    assert max_bucket([10, 20, 5], cap=25) == 25 and max_bucket([8], cap=25) == 8


def test_hardware_catalog(tmp_path):
    trn2 = get_hardware("trn2.48xlarge")
    assert (trn2.ranks_per_node, trn2.memory_per_rank, trn2.device, trn2.backend) == (64, 24 * GiB, "neuron", "neuron")
    assert round(trn2.peak_flops_per_rank / 1e12) == 167  # AWS: 667 TFLOP/s per Trainium2 chip, 4 ranks at LNC=2
    trn1 = get_hardware("trn1")
    assert (trn1.ranks_per_node, trn1.memory_per_rank, trn1.planning_only) == (32, 16 * GiB, True)
    assert get_hardware("p5.48xlarge").backend == "nccl" and get_hardware("h200x8").memory_per_rank == 141e9
    cpu = get_hardware("cpu", 2)
    assert (cpu.ranks_per_node, cpu.backend) == (2, "gloo") and cpu.memory_per_rank > 0
    assert {"trn1.32xlarge", "trn2.48xlarge", "trn3", "p5.48xlarge", "h200x8", "cpu"} <= set(hardware_names())
    path = tmp_path / "trn1n.yaml"
    path.write_text(
        "ranks_per_node: 32\nmemory_per_rank: 16GiB\npeak_flops_per_rank: 95e12\n"
        "intra_node_bw: 384GiB\ninter_node_bw: 200e9\ndevice: neuron\n"
    )
    spec = load_hardware(path)
    assert spec.name == "trn1n" and spec.memory_per_rank == 16 * GiB and get_hardware("trn1n") is spec
    trn1n = get_hardware("trn1n")  # configs/hardware/trn1n.yaml
    assert trn1n.inter_node_bw == 2 * trn1.inter_node_bw and "trn1n" in hardware_names()
    with pytest.raises(ValueError, match="unknown hardware 'trn9'"):
        get_hardware("trn9")


def test_compute_runs_at_the_peak_of_the_precision_run():
    """AWS's Trainium2 page: 667 bf16 and 181 FP32 TFLOP/s per chip (4 ranks at LNC=2); NVIDIA's
    H100/H200 datasheet: TF32 989 TFLOP/s with sparsity, half of it dense, the rate of fp32
    matmuls with TF32 enabled. The same layout computes slower in fp32 by exactly that ratio,
    and its MFU is against the fp32 peak."""
    trn2, h200, cpu = get_hardware("trn2"), get_hardware("h200x8"), get_hardware("cpu", 2)
    assert trn2.peak_flops("fp32") == 181e12 / 4 and trn2.peak_flops("bf16_autocast") == 667e12 / 4
    assert h200.peak_flops("fp32") == 989e12 / 2 and h200.peak_flops("bf16") == 989e12
    assert cpu.peak_flops("fp32") == cpu.peak_flops("bf16_autocast")  # one nominal figure on CPU
    layout = dict(tp=8, pp=1, cp=1, zero_1=True, sequence_parallel=True, activation_checkpointing=1, micro_batch_size=1)
    kw = dict(seq_len=4096, global_batch=64, fixed=layout)
    fp32, bf16 = (search_layouts(LLAMA_8B, "trn2", precision=p, **kw).candidates for p in ("fp32", "bf16_autocast"))
    assert len(fp32) == len(bf16) == 1
    assert fp32[0].time["compute_s"] / bf16[0].time["compute_s"] == pytest.approx(667 / 181)
    assert fp32[0].mfu * fp32[0].step_time_s * 181 == pytest.approx(bf16[0].mfu * bf16[0].step_time_s * 667)


def test_llama_8b_on_32_trn1(plans_trn1):
    report = plans_trn1["8b-32"]
    assert report.feasible and report.best.fits and report.world_size == 1024
    best = report.best
    assert best.tp * best.pp * best.dp == 1024 and best.memory_per_rank_bytes <= 16 * GiB
    # The published configuration: TP32, DP32, ZeRO-1 (with SP and recompute, as published runs use).
    published = _published(report, 32, 1, 32)
    assert published and all(c.fits for c in published)
    assert any(
        c.fits
        for c in report.candidates
        if (c.tp, c.pp, c.dp, c.zero_1) == (32, 1, 32, True) and not c.activation_checkpointing
    )
    assert "KV heads replicated 4x" in published[0].notes[0]
    # Per-rank breakdown and step time are there, and MFU is plausible.
    assert {"params", "grads", "optimizer", "activations", "loss", "allocator_margin", "total"} <= set(best.memory)
    assert 0.05 < best.mfu < 0.6 and best.tokens_per_s > 0


def test_llama_70b_on_one_trn1_is_infeasible(plans_trn1):
    report = plans_trn1["70b-1"]
    assert not report.feasible and report.best is None
    assert "needs" in report.reason and "at least 3 nodes" in report.reason
    assert all(not c.fits and c.reason for c in report.candidates)
    smallest = report.candidates[0]
    assert smallest.memory_per_rank_bytes > 16 * GiB and "16.0 GiB" in smallest.reason


def test_llama_70b_on_32_trn1(plans_trn1):
    report = plans_trn1["70b-32"]
    assert report.feasible
    published = _published(report, 32, 8, 4)
    assert published and all(c.fits for c in published)
    # Without recompute the same split does not fit: the activations of 8 in-flight microbatches.
    bare = [
        c
        for c in report.candidates
        if (c.tp, c.pp, c.dp) == (32, 8, 4)
        and not c.activation_checkpointing
        and c.pipeline_schedule == "1f1b"
        and c.valid
    ]
    assert bare and not any(c.fits for c in bare) and "activations" in bare[0].reason


def test_constraints_name_the_reason():
    shape = dict(LLAMA_8B, num_attention_heads=24, num_key_value_heads=8, num_hidden_layers=4, vocab_size=1000)
    report = search_layouts(shape, "p5.48xlarge", nodes=2, seq_len=1024, global_batch=6)
    reasons = {(c.tp, c.pp): c.reason for c in report.candidates if not c.valid}
    assert "does not fit within a p5.48xlarge node of 8 ranks" in reasons[(16, 1)]
    assert "tp=16 does not divide num_attention_heads=24" in reasons[(16, 1)]
    assert "exceeds the model's 4 layers" in reasons[(1, 8)]
    assert "global batch 6 is not divisible by dp=4" in reasons[(4, 1)]
    assert "vocab_size=1000" in reasons[(16, 1)]
    fitting = [c for c in report.candidates if c.fits]
    assert fitting and all(c.valid and c.reason is None for c in fitting)
    # Best first: fitting plans by predicted tokens/s.
    speeds = [c.tokens_per_s for c in fitting]
    assert speeds == sorted(speeds, reverse=True) or max(speeds) == speeds[0]


def test_pipeline_memory_follows_the_schedule():
    shape = ModelShape.from_config(LLAMA_8B)
    kw = dict(
        tp=8,
        pp=4,
        dp=1,
        zero_1=False,
        sp=True,
        recompute=0,
        micro_batch=1,
        seq_len=4096,
        num_microbatches=16,
        grad_accum=1,
        virtual_stages=1,
        precision="bf16",
        layers=[8] * 4,
    )
    one_f = stage_memory(shape, schedule="1f1b", pp_rank=0, **kw)
    gpipe = stage_memory(shape, schedule="gpipe", pp_rank=0, **kw)
    last = stage_memory(shape, schedule="1f1b", pp_rank=3, **kw)
    assert gpipe.activations > 3 * one_f.activations  # 16 in flight against p = 4
    assert last.loss > 0 and one_f.loss == 0  # the logits live on the last stage only


def test_tiny_cpu_best_plan_passes_check_layout(tiny_world):
    from neuron_parallel.config import DataConfig, JobConfig, TrainConfig
    from neuron_parallel.planning.layout import check_layout

    hw = get_hardware("cpu", 2)
    report = search_layouts(tiny_world["model"], hw, nodes=1, seq_len=128, global_batch=16, precision="fp32")
    assert report.feasible
    for c in [report.best] + [c for c in report.candidates if c.fits]:
        job = JobConfig(
            model_path=tiny_world["model"],
            dataset_path="",
            output_dir="",
            data=DataConfig(block_size=128),
            parallel=c.to_parallel_config(),
            train=TrainConfig(micro_batch_size=c.micro_batch_size, global_batch_size=16),
        )
        checked = check_layout(job)
        assert checked.world_size == 2 and checked.global_batch_size == 16
        assert job.parallel.mixed_precision == "fp32"


def test_cli_plan_json(tmp_path, capsys):
    from neuron_flows.flows.cli import main

    (tmp_path / "config.json").write_text(json.dumps(LLAMA_70B))
    args = [
        "plan",
        "--model",
        str(tmp_path),
        "--hardware",
        "trn1.32xlarge",
        "--nodes",
        "1",
        "--seq-len",
        "8192",
        "--global-batch",
        "1024",
        "--json",
    ]
    assert main(args) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["feasible"] is False and out["candidates"] and "at least 3 nodes" in out["reason"]
    keys = {
        "tp",
        "pp",
        "dp",
        "zero_1",
        "sequence_parallel",
        "num_microbatches",
        "activation_checkpointing",
        "memory_per_rank_bytes",
        "fits",
        "tokens_per_s",
        "memory",
        "reason",
    }
    assert all(keys <= set(p) and p["reason"] for p in out["candidates"])
    assert (
        main(
            [
                "plan",
                "--model",
                json.dumps(LLAMA_8B),
                "--hardware",
                "h200x8",
                "--nodes",
                "1",
                "--seq-len",
                "4096",
                "--global-batch",
                "64",
            ]
        )
        == 0
    )
    assert "feasible: True" in capsys.readouterr().out


def test_pinned_fields_restrict_the_search():
    report = search_layouts(
        LLAMA_8B,
        "trn2.48xlarge",
        nodes=1,
        seq_len=4096,
        global_batch=64,
        fixed={"tp": 8, "zero_1": True, "activation_checkpointing": 2},
    )
    assert report.feasible and report.candidates
    assert {(c.tp, c.zero_1, c.activation_checkpointing) for c in report.candidates if c.valid} == {(8, True, 2)}
    with pytest.raises(ValueError, match="cannot pin"):
        search_layouts(LLAMA_8B, "trn2.48xlarge", seq_len=4096, global_batch=64, fixed={"dp": 2})


def _auto_config(tiny_world, *overrides):
    from neuron_flows.tasks.config import FinetuneConfig

    return FinetuneConfig.load(
        None,
        [
            f"model.name_or_path={tiny_world['model']}",
            "launch.nproc_per_node=4",
            "data.block_size=32",
            "train.global_batch_size=8",
            *overrides,
        ],
    )


def test_auto_layout_is_the_planners_best_with_pins_kept(tiny_world):
    from neuron_flows.tasks import steps

    free, report = steps.plan(_auto_config(tiny_world), tiny_world["model"])
    best = report.best
    assert (free.parallel.tp, free.parallel.pp, free.parallel.dp, free.parallel.zero_1) == (
        best.tp,
        best.pp,
        best.dp,
        best.zero_1,
    )
    assert free.micro_batch_size * free.grad_accum * free.parallel.dp == free.global_batch_size == 8
    assert free.predicted_memory_bytes == best.memory_per_rank_bytes and "chosen by the planner" in free.notes[-1]
    pinned, report = steps.plan(_auto_config(tiny_world, "parallel.tp=2", "parallel.pp=2"), tiny_world["model"])
    assert (pinned.parallel.tp, pinned.parallel.pp, pinned.parallel.dp) == (2, 2, 1)
    assert pinned.parallel.num_microbatches >= 2 and pinned.global_batch_size == 8
    assert all((c.tp, c.pp) == (2, 2) for c in report.candidates)
    fixed, report = steps.plan(
        _auto_config(
            tiny_world,
            *PINNED_LAYOUT,
            "train.micro_batch_size=2",
        ),
        tiny_world["model"],
    )
    assert report is None and fixed.parallel.dp == 4 and fixed.micro_batch_size == 2
    # One batch rule: the global batch is train.global_batch_size whatever is pinned or planned.
    for layout in (free, pinned, fixed):
        assert layout.global_batch_size == 8 and layout.world_size == 4
        assert layout.grad_accum * layout.micro_batch_size * layout.parallel.dp == 8, layout


def test_auto_layout_that_cannot_fit_says_why_before_launch(tiny_world, tmp_path):
    from neuron_flows.tasks import steps

    (tmp_path / "small.yaml").write_text(
        "name: small\nranks_per_node: 4\nmemory_per_rank: 1MiB\n"
        "peak_flops_per_rank: 1e12\nintra_node_bw: 1e10\ninter_node_bw: 1e9\n"
        "device: cpu\n"
    )
    config = _auto_config(tiny_world, f"launch.hardware={tmp_path / 'small.yaml'}")
    with pytest.raises(ValueError, match=r"no parallel layout fits: no layout fits 0\.0 GiB per small rank"):
        steps.plan(config, tiny_world["model"])


def test_layer_split_pins_the_stage_count(tiny_world):
    from neuron_flows.tasks import steps

    chosen, _ = steps.plan(_auto_config(tiny_world, "parallel.pp=2", "parallel.layer_split=[1,3]"), tiny_world["model"])
    assert chosen.parallel.virtual_stages == 1 and chosen.layers_per_stage == [1, 3]
    with pytest.raises(ValueError, match=r"layer_split=\[1, 2\] must be 2 positive counts"):
        steps.plan(_auto_config(tiny_world, "parallel.pp=2", "parallel.layer_split=[1,2]"), tiny_world["model"])
