"""What a LoRA checkpoint holds and how its export names things, without any process: the
tensors validation expects, peft's key names, and an ``adapter_config.json`` peft reads as is."""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path

import pytest

from neuron_parallel.checkpoint.adapter import peft_config, peft_name
from neuron_parallel.checkpoint.format import Manifest
from neuron_parallel.checkpoint.shapes import expected_adapter_shapes
from neuron_parallel.config import LoraConfig


def model_config(tiny_world, key: str) -> dict:
    return json.loads((Path(tiny_world[key]) / "config.json").read_text())


def manifest_for(config: dict, lora: LoraConfig) -> Manifest:
    adapter = {"lora": dataclasses.asdict(lora), "base_model": {"name_or_path": "/models/base", "sha256": "0" * 64}}
    return Manifest(step=1, parallel={}, model_config=config, files={}, tensors={}, adapter=adapter)


def test_expected_tensors_are_the_adapters_of_targeted_layers_and_the_modules_to_save(tiny_world):
    config = model_config(tiny_world, "model")  # 4 layers, hidden 128, 2 KV heads of 32, MLP 352
    lora = dataclasses.asdict(LoraConfig(r=4, target_modules=["k_proj", "down_proj"], modules_to_save=["lm_head"]))
    want = expected_adapter_shapes(config, lora)
    assert len(want) == 4 * 2 * 2 + 1
    assert want["model.layers.3.self_attn.k_proj.lora_A"] == [4, 128]
    assert want["model.layers.3.self_attn.k_proj.lora_B"] == [64, 4]
    assert want["model.layers.0.mlp.down_proj.lora_A"] == [4, 352]
    assert want["model.layers.0.mlp.down_proj.lora_B"] == [128, 4]
    assert want["lm_head.weight"] == [2048, 128]
    assert not any(name.endswith("q_proj.lora_A") or "layernorm" in name for name in want)

    tied = expected_adapter_shapes(model_config(tiny_world, "qwen2"), {**lora, "modules_to_save": ["lm_head"]})
    assert "lm_head.weight" not in tied and tied["model.embed_tokens.weight"] == [2048, 128]


def test_peft_key_names():
    assert peft_name("model.layers.0.self_attn.q_proj.lora_A") == (
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    )
    down = "model.layers.7.mlp.down_proj.lora_B"
    assert peft_name(down) == f"base_model.model.{down}.weight"
    assert peft_name("lm_head.weight") == "base_model.model.lm_head.weight"


@pytest.mark.parametrize("key", ["model", "qwen2"])
def test_adapter_config_is_a_peft_lora_config(tiny_world, key):
    from peft import LoraConfig as PeftLoraConfig
    from peft import PeftConfig

    config = model_config(tiny_world, key)
    lora = LoraConfig(r=4, alpha=12.0, dropout=0.1, target_modules=["v_proj", "q_proj"], modules_to_save=["lm_head"])
    raw = peft_config(manifest_for(config, lora), base_model_name="org/base", base_model_revision="v1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an unknown field would be a warning
        loaded = PeftConfig.from_peft_type(**raw)
    assert isinstance(loaded, PeftLoraConfig)
    assert (loaded.r, loaded.lora_alpha, loaded.lora_dropout) == (4, 12, 0.1)
    assert loaded.target_modules == {"q_proj", "v_proj"} and loaded.task_type == "CAUSAL_LM"
    assert (loaded.base_model_name_or_path, loaded.revision) == ("org/base", "v1")
    assert (loaded.bias, loaded.use_rslora, loaded.use_dora, loaded.fan_in_fan_out) == ("none", False, False, False)
    if config["tie_word_embeddings"]:  # the trained embedding is the head too: peft keeps them tied
        assert loaded.ensure_weight_tying and loaded.modules_to_save == ["embed_tokens"]
    else:
        assert not loaded.ensure_weight_tying and loaded.modules_to_save == ["lm_head"]
    assert peft_config(manifest_for(config, lora))["base_model_name_or_path"] == "/models/base"
