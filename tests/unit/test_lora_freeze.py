"""Which parameters LoRA trains: the adapters, and modules_to_save (one weight when tied)."""

import pytest

from neuron_parallel.config import LoraConfig
from neuron_parallel.models.causal_lm import CausalLMStage, build_meta_model, load_config
from neuron_parallel.parallel.lora import add_lora, freeze_base


def _trainable(model_dir, lora: LoraConfig, *, first: bool, last: bool, layers: range) -> set[str]:
    config = load_config(model_dir)
    stage = CausalLMStage(build_meta_model(config), layers, first=first, last=last)
    add_lora(stage, lora)
    freeze_base(stage, lora, tied=bool(config.tie_word_embeddings))
    return {n for n, p in stage.named_parameters() if p.requires_grad}


def test_only_adapters_are_trained_by_default(tiny_world):
    names = _trainable(tiny_world["model"], LoraConfig(r=2), first=True, last=True, layers=range(4))
    assert names and all(n.endswith((".lora_A", ".lora_B")) for n in names)
    assert len(names) == 2 * 7 * 4


@pytest.mark.parametrize("saved", ["lm_head", "embed_tokens"])
def test_a_tied_embedding_is_trained_on_both_pipeline_ends_whichever_name_is_given(tiny_world, saved):
    lora = LoraConfig(r=2, target_modules=["q_proj"], modules_to_save=[saved])
    first = _trainable(tiny_world["qwen2"], lora, first=True, last=False, layers=range(2))
    last = _trainable(tiny_world["qwen2"], lora, first=False, last=True, layers=range(2, 4))
    assert "model.embed_tokens.weight" in first and "lm_head.weight" in last
    untied = _trainable(tiny_world["model"], lora, first=False, last=True, layers=range(2, 4))
    assert ("lm_head.weight" in untied) == (saved == "lm_head")
