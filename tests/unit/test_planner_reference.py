"""The planner under a preference objective: DPO under LoRA runs the frozen base's forward once more
per micro-batch for its reference (``neuron_parallel.planning.reference``), one forward in time,
its transient peak and, under pp, its own receive buffers in memory; the other objectives and DPO
fine-tuning every weight (which reads the reference step's values) add nothing; the plan step
passes the config's objective on. Pure Python, but for the tiny model the last test plans on."""

import pytest

from neuron_parallel.config import DataConfig, JobConfig, LoraConfig, ParallelConfig, TrainConfig
from neuron_parallel.planning.hardware import get_hardware
from neuron_parallel.planning.memory import STATES, ModelShape, job_rank_memory, stage_memory
from neuron_parallel.planning.reference import forward_work, reference_forward
from neuron_parallel.planning.search import search_layouts
from neuron_parallel.planning.timing import links

from .test_planner import LLAMA_8B

LORA = LoraConfig(r=16)
SEQ = 4096


def test_only_dpo_under_lora_runs_a_reference_forward():
    assert reference_forward("dpo", LORA)
    assert not any(reference_forward(objective, LORA) for objective in ("sft", "simpo", "orpo"))
    assert not reference_forward("dpo", None)


def _stage(shape, objective, *, pp, pp_rank, m=4):
    kw = dict(tp=4, pp=pp, dp=1, zero_1=False, sp=False, recompute=0, micro_batch=1, seq_len=SEQ, grad_accum=1)
    kw.update(num_microbatches=m if pp > 1 else 1, schedule="1f1b", virtual_stages=1, precision="bf16_autocast")
    layers = [shape.num_layers // pp] * pp
    return stage_memory(shape, **kw, pp_rank=pp_rank, layers=layers, lora=LORA, device="neuron", objective=objective)


def test_the_reference_forward_peaks_over_the_policys_saved_activations():
    # A small vocabulary keeps the loss buffers below a layer's forward work, so the moment of
    # the reference forward (after the policy's forward, before its backward) is the peak.
    shape = ModelShape.from_config(dict(LLAMA_8B, vocab_size=1024))
    sft, dpo = _stage(shape, "sft", pp=1, pp_rank=0), _stage(shape, "dpo", pp=1, pp_rank=0)
    assert (sft.phase, dpo.phase) == ("backward", "reference")
    assert dpo.activations == sft.activations and dpo.loss == 0 and dpo.pipeline_buffers == 0
    assert dpo.transient == SEQ * forward_work(shape, 4, STATES["bf16_autocast"].act) > sft.transient
    assert dpo.total > sft.total
    # Llama's own vocabulary: the loss buffers at the start of backward outweigh it, nothing changes.
    shape = ModelShape.from_config(LLAMA_8B)
    assert _stage(shape, "dpo", pp=1, pp_rank=0) == _stage(shape, "sft", pp=1, pp_rank=0)


def test_the_reference_pass_holds_its_own_receive_buffers_under_pp():
    shape, m = ModelShape.from_config(LLAMA_8B), 4
    boundary = SEQ * shape.hidden_size * STATES["bf16_autocast"].resid  # one microbatch's activation, fp32
    sft, dpo = _stage(shape, "sft", pp=2, pp_rank=1, m=m), _stage(shape, "dpo", pp=2, pp_rank=1, m=m)
    assert dpo.phase == sft.phase and dpo.pipeline_buffers == sft.pipeline_buffers + m * boundary
    assert dpo.total == sft.total + m * boundary
    # the first stage receives no activation: nothing more held
    assert _stage(shape, "dpo", pp=2, pp_rank=0, m=m) == _stage(shape, "sft", pp=2, pp_rank=0, m=m)


def test_the_engine_side_prediction_reads_the_jobs_objective():
    shape = ModelShape.from_config(LLAMA_8B)

    def job(objective):
        parallel = ParallelConfig(pp=2, num_microbatches=2)
        train = TrainConfig(micro_batch_size=2, global_batch_size=2, lora=LORA, objective=objective)
        data = DataConfig(block_size=SEQ, format="preference")
        return JobConfig(model_path="", dataset_path="", output_dir="", data=data, parallel=parallel, train=train)

    last = 1  # global rank 1: pp rank 1
    assert job_rank_memory(shape, job("dpo"), last).total > job_rank_memory(shape, job("simpo"), last).total


@pytest.mark.parametrize("lora", [LORA, None], ids=["lora", "full"])
def test_the_reference_forward_costs_one_forward_of_the_base_per_micro_batch(lora):
    kw = dict(nodes=1, seq_len=SEQ, global_batch=64, lora=lora, fixed={"tp": 1, "pp": 1, "cp": 1})
    plans = {o: search_layouts(LLAMA_8B, "trn2.48xlarge", objective=o, **kw) for o in ("sft", "simpo", "dpo")}
    assert plans["dpo"].to_dict()["objective"] == "dpo"
    shape, hw = ModelShape.from_config(LLAMA_8B), get_hardware("trn2.48xlarge")
    forward = shape.flops_per_token(SEQ) / 3 - 2 * shape.hidden_size  # PaLM's 6N + 12LHQT, a third, less the norm
    for sft, simpo, dpo in zip(*(plans[o].candidates for o in ("sft", "simpo", "dpo"))):
        assert sft.describe() == simpo.describe() == dpo.describe()
        assert "reference_s" not in sft.time and simpo.time == sft.time
        if lora is None:  # the reference step's values: nothing in the step
            assert dpo.time == sft.time
            continue
        seconds = dpo.grad_accum * dpo.micro_batch_size * SEQ * forward / (hw.peak_flops(dpo.precision) * hw.efficiency)
        assert dpo.time["reference_s"] == pytest.approx(seconds, rel=1e-12)
        assert dpo.time["total_s"] == pytest.approx(sft.time["total_s"] + seconds, rel=1e-12)
        assert dpo.tokens_per_s < sft.tokens_per_s
    if lora is None:
        return
    # Under pp the pass is a pipeline of its own: m + p - 1 slots of the slowest stage's forward
    # (the last: 16 layers and the lm_head) and its boundary send, with one send's latency.
    kw["fixed"] = {"tp": 1, "pp": 2, "cp": 1, "pipeline_schedule": "1f1b"}
    last = forward - 16 * (2 * shape.layer_params + 4 * shape.num_heads * shape.head_dim * SEQ)
    for c in search_layouts(LLAMA_8B, "trn2.48xlarge", objective="dpo", **kw).candidates:
        tokens = c.micro_batch_size // c.num_microbatches * SEQ
        send = tokens * shape.hidden_size * STATES[c.precision].resid / links(hw, 1, 2, c.dp)["pp"]
        send += hw.call_latency + hw.link_latency  # a ring of 2 ranks within a node: one step
        slot = tokens * last / (hw.peak_flops(c.precision) * hw.efficiency) + send
        assert c.time["reference_s"] == pytest.approx(c.grad_accum * (c.num_microbatches + 1) * slot, rel=1e-12)


def test_the_plan_step_plans_for_the_configs_objective(tiny_world):
    from neuron_flows.tasks import steps
    from neuron_flows.tasks.config import FinetuneConfig

    sets = [
        f"model.name_or_path={tiny_world['model']}",
        f"data.source={tiny_world['preference']}",
        "data.format=preference",
        "launch.nproc_per_node=2",
        "data.block_size=32",
        "train.global_batch_size=8",
        "train.lora={r: 4}",
    ]
    plans = {
        o: steps.plan(FinetuneConfig.load(None, [*sets, f"train.objective={o}"]), tiny_world["model"])[1]
        for o in ("simpo", "dpo")
    }
    assert plans["dpo"].objective == "dpo" and "reference_s" in plans["dpo"].best.time
    assert "reference_s" not in plans["simpo"].best.time
