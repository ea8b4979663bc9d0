"""Pipeline parallelism: stage placement and layer splits (pure Python, meta device). The
multi-rank parity cases are in tests/dist/test_pipeline_parallel.py."""

from __future__ import annotations

import pytest
import torch

from neuron_parallel.config import ParallelConfig
from neuron_parallel.parallel.pipeline import PipelineRunner, build_stages, stage_ids_for_rank


# --------------------------------------------------------------------------- placement, splits
@pytest.mark.parametrize(
    "schedule, pp, v, expected",
    [
        ("gpipe", 4, 1, [[0], [1], [2], [3]]),
        ("1f1b", 2, 1, [[0], [1]]),
        ("interleaved_1f1b", 2, 2, [[0, 2], [1, 3]]),
        ("interleaved_1f1b", 4, 3, [[0, 4, 8], [1, 5, 9], [2, 6, 10], [3, 7, 11]]),
        ("zbv", 2, 2, [[0, 3], [1, 2]]),
        ("zbv", 4, 2, [[0, 7], [1, 6], [2, 5], [3, 4]]),
    ],
)
def test_stage_ids_for_rank(schedule, pp, v, expected):
    got = [stage_ids_for_rank(r, pp, v, schedule) for r in range(pp)]
    assert got == expected
    assert sorted(s for ids in got for s in ids) == list(range(pp * v))  # each stage exactly once


@pytest.mark.parametrize(
    "args, match",
    [
        ((0, 2, 2, "1f1b"), "one stage per rank"),
        ((0, 2, 1, "interleaved_1f1b"), "virtual_stages >= 2"),
        ((0, 2, 3, "zbv"), "exactly 2"),
        ((2, 2, 1, "1f1b"), "pp_rank"),
        ((0, 2, 1, "dualpipe"), "not one of"),
    ],
)
def test_stage_ids_for_rank_rejects_bad_layouts(args, match):
    with pytest.raises(ValueError, match=match):
        stage_ids_for_rank(*args)


def _meta_model(layers=6, tied=False):
    from transformers import LlamaConfig

    from neuron_parallel.models.causal_lm import build_meta_model

    config = LlamaConfig(
        hidden_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=256,
        tie_word_embeddings=tied,
    )
    return build_meta_model(config), config


def _layers(stage) -> list[int]:
    return [int(k) for k in stage.model.layers.keys()]


def test_build_stages_even_and_user_splits_keep_hf_names():
    full, config = _meta_model(6)
    # Even split of 6 layers over 4 stages gives the extra layers to the earlier stages.
    r0 = build_stages(full, config, pp_rank=0, pp=2, virtual_stages=2, schedule="interleaved_1f1b")
    r1 = build_stages(full, config, pp_rank=1, pp=2, virtual_stages=2, schedule="interleaved_1f1b")
    assert [_layers(s) for s in r0] == [[0, 1], [4]]
    assert [_layers(s) for s in r1] == [[2, 3], [5]]
    assert [(s.first, s.last) for s in r0 + r1] == [(True, False), (False, False), (False, False), (False, True)]
    assert all(p.is_meta for s in r0 + r1 for p in s.parameters())

    # A user split; the V placement puts the first and the last stage on rank 0.
    v0 = build_stages(full, config, pp_rank=0, pp=2, virtual_stages=2, schedule="zbv", layer_split=[1, 2, 2, 1])
    assert [_layers(s) for s in v0] == [[0], [5]]
    names = {n for s in v0 for n, _ in s.named_parameters()}
    assert {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"} <= names
    assert "model.layers.5.mlp.up_proj.weight" in names and "model.layers.1.mlp.up_proj.weight" not in names

    one = build_stages(
        full, config, pp_rank=1, pp=2, virtual_stages=1, schedule="1f1b", layer_split=[4, 2], recompute_every=1
    )
    assert _layers(one[0]) == [4, 5] and one[0].last and one[0].recompute_every == 1
    with pytest.raises(ValueError, match="layer_split"):
        build_stages(full, config, pp_rank=0, pp=2, virtual_stages=1, schedule="1f1b", layer_split=[3, 2])


def test_build_stages_splits_match_parallel_config():
    # ParallelConfig validates the same combinations the builder accepts.
    pc = ParallelConfig(pp=2, pipeline_schedule="zbv", virtual_stages=2, num_microbatches=4)
    full, config = _meta_model(4)
    stages = [
        s
        for r in range(pc.pp)
        for s in build_stages(
            full, config, pp_rank=r, pp=pc.pp, virtual_stages=pc.virtual_stages, schedule=pc.pipeline_schedule
        )
    ]
    assert sorted(layer for s in stages for layer in _layers(s)) == list(range(4))


def test_runner_rejects_a_stage_count_the_schedule_cannot_run():
    full, config = _meta_model(4)
    stages = build_stages(full, config, pp_rank=0, pp=1, virtual_stages=2, schedule="interleaved_1f1b")
    with pytest.raises(ValueError, match="cannot run 2 stage"):
        PipelineRunner(
            stages,
            [0, 1],
            2,
            pp_group=None,
            device=torch.device("cpu"),
            schedule="1f1b",
            num_microbatches=2,
            loss_fn=None,
        )
