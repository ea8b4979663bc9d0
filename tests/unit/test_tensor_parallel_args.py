"""Tensor/sequence parallelism (neuron_parallel.parallel.tensor): the argument checks, which need
no process group. The multi-rank parity cases are in tests/dist/test_tensor_parallel.py."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch
from torch.distributed.tensor import DTensor

from neuron_parallel.models.causal_lm import CausalLMStage, build_meta_model
from neuron_parallel.parallel.tensor import apply_tensor_parallel, kv_size_multiplier


def meta_stage(**overrides) -> CausalLMStage:
    from transformers import LlamaConfig

    shape = dict(
        hidden_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=256,
    )
    full = build_meta_model(LlamaConfig(**{**shape, **overrides}))
    return CausalLMStage(full, range(1), first=True, last=True)


def fake_mesh(tp: int):
    """Only the mesh's size is read before the arguments are validated."""
    return SimpleNamespace(ndim=1, size=lambda: tp, mesh_dim_names=("tp",))


TWELVE_HEADS = {"hidden_size": 96, "num_attention_heads": 12}


def test_kv_size_multiplier():
    assert [kv_size_multiplier(2, tp) for tp in (1, 2, 4, 8)] == [1, 1, 2, 4]
    assert kv_size_multiplier(8, 4) == 1


@pytest.mark.parametrize(
    "overrides,tp,message",
    [
        ({}, 3, "tp=3 does not divide num_attention_heads=4"),
        (TWELVE_HEADS | {"num_key_value_heads": 4}, 6, "tp=6 > num_key_value_heads=4 needs tp to be a multiple"),
        (TWELVE_HEADS | {"num_key_value_heads": 6}, 4, "tp=4 does not divide num_key_value_heads=6"),
        ({"intermediate_size": 130}, 4, "tp=4 does not divide intermediate_size=130"),
        ({"vocab_size": 250}, 4, "pad the vocabulary to 252 rows"),
    ],
)
def test_invalid_tp_is_refused(overrides, tp, message):
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        apply_tensor_parallel(meta_stage(**overrides), fake_mesh(tp), sequence_parallel=True)
    assert "valid tp for this model: [" in str(info.value)


def test_valid_tp_values_are_listed():
    with pytest.raises(ValueError) as info:
        stage = meta_stage(**TWELVE_HEADS, num_key_value_heads=4, intermediate_size=192)
        apply_tensor_parallel(stage, fake_mesh(5), sequence_parallel=False)
    # 3 and 6 fit neither way with 4 KV heads; 12 does not divide the stage's vocabulary of 256
    assert "valid tp for this model: [1, 2, 4]" in str(info.value)


def test_tp1_leaves_stage_alone():
    stage = meta_stage()
    assert apply_tensor_parallel(stage, fake_mesh(1), sequence_parallel=True) is stage
    assert not any(isinstance(p, DTensor) for p in stage.parameters())
    assert all(p.device == torch.device("meta") for p in stage.parameters())
