"""Layout checks against the model: each refusal names the numbers and a valid alternative."""

import pytest

from neuron_parallel.config import DataConfig, JobConfig, ParallelConfig, TrainConfig
from neuron_parallel.planning.layout import check_layout, describe_layout
from neuron_parallel.planning.search import Candidate


def job(model, **parallel):
    world = parallel.pop("world", None)
    pc = ParallelConfig.for_world(world, **parallel) if world else ParallelConfig(**parallel)
    return JobConfig(
        model_path=model,
        dataset_path="",
        output_dir="",
        data=DataConfig(block_size=32),
        parallel=pc,
        train=TrainConfig(micro_batch_size=4),
    )


def test_plan_accepts_dp_and_counts_parameters(tiny_world):
    from transformers import AutoModelForCausalLM

    plan = check_layout(job(tiny_world["model"], world=2))
    model = AutoModelForCausalLM.from_pretrained(tiny_world["model"])
    assert plan.parallel.dp == 2 and plan.global_batch_size == 8
    assert plan.num_parameters == sum(p.numel() for p in model.parameters())
    assert plan.layers_per_stage == [4]


@pytest.mark.parametrize(
    "parallel, match",
    [
        (dict(tp=3), "tp=3 does not divide num_attention_heads=4.*valid tp for this model: \\[1, 2, 4\\]"),
        (dict(pp=5, num_microbatches=4), "5 pipeline stages .* exceed the model's 4 layers"),
        (dict(pp=2, num_microbatches=3), "micro_batch_size=4 is not divisible by parallel.num_microbatches=3"),
        (dict(pp=2, num_microbatches=1), "num_microbatches=1 is below pp=2"),
    ],
)
def test_bad_plans_name_the_fix(tiny_world, parallel, match):
    with pytest.raises(ValueError, match=match):
        check_layout(job(tiny_world["model"], **parallel))


def test_world_size_must_be_divisible():
    with pytest.raises(ValueError, match="not divisible by cp × tp × pp = 1 × 2 × 2 = 4"):
        ParallelConfig.for_world(6, tp=2, pp=2)


def test_one_printed_form_of_a_layout_for_config_and_planner():
    pc = ParallelConfig(dp=2, tp=2, zero_1=True, sequence_parallel=True)
    assert describe_layout(pc) == "tp=2 pp=1 dp=2 zero1 sp"
    piped = ParallelConfig(pp=2, num_microbatches=4, activation_checkpointing=2)
    assert describe_layout(piped) == "tp=1 pp=2 dp=1 recompute-every-2 1f1b×4"
    c = Candidate(tp=1, pp=2, dp=1, num_microbatches=4, activation_checkpointing=1, micro_batch_size=4, grad_accum=2)
    assert c.describe() == "tp=1 pp=2 dp=1 recompute 1f1b×4 mbs=4 accum=2"
    assert c.describe().startswith(describe_layout(c.to_parallel_config()))
