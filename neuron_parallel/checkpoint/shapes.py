"""Model shapes: the parameters a model config describes, and the tensors a LoRA checkpoint holds
for it (the adapters of its targeted layers, its ``modules_to_save``)."""

from __future__ import annotations

import re

import torch


def expected_shapes(model_config: dict) -> dict[str, list[int]]:
    """Hugging Face parameter names and shapes of the model a config describes (built on the
    meta device: no memory), the tied lm_head left out."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**model_config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return {name: list(p.shape) for name, p in model.named_parameters()}


MODULE_WEIGHTS = {"lm_head": "lm_head.weight", "embed_tokens": "model.embed_tokens.weight"}
"""``train.lora.modules_to_save`` entries and the Hugging Face weight each trains in full."""


def lora_targets(names, target_modules: list[str]) -> list[str]:
    """The linear weights among ``names`` that carry an adapter: ``model.layers.<i>.self_attn.<t>.weight``
    or ``model.layers.<i>.mlp.<t>.weight`` for ``t`` in ``target_modules``, as the engine's
    ``add_lora`` chooses them."""
    targets = "|".join(re.escape(t) for t in target_modules)
    pattern = re.compile(rf"model\.layers\.\d+\.(?:self_attn|mlp)\.(?:{targets})\.weight")
    return [name for name in names if pattern.fullmatch(name)]


def saved_module_names(model_config: dict, modules_to_save: list[str]) -> list[str]:
    """Checkpoint names of the ``modules_to_save`` weights: a tied lm_head is the embedding,
    stored once under ``model.embed_tokens.weight``."""
    tied = bool(model_config.get("tie_word_embeddings"))
    names = [MODULE_WEIGHTS["embed_tokens"] if tied else MODULE_WEIGHTS[m] for m in modules_to_save]
    return list(dict.fromkeys(names))


def expected_adapter_shapes(model_config: dict, lora: dict) -> dict[str, list[int]]:
    """Checkpoint names and global shapes of a LoRA checkpoint's model tensors: ``<layer>.lora_A``
    (r × in) and ``<layer>.lora_B`` (out × r) of every targeted projection, and the whole
    ``modules_to_save`` weights. No base weight: those belong to the base model."""
    model = expected_shapes(model_config)
    want: dict[str, list[int]] = {}
    for name in lora_targets(model, lora["target_modules"]):
        out_dim, in_dim = model[name]
        layer = name.removesuffix(".weight")
        want[f"{layer}.lora_A"] = [lora["r"], in_dim]
        want[f"{layer}.lora_B"] = [out_dim, lora["r"]]
    for name in saved_module_names(model_config, lora.get("modules_to_save", [])):
        want[name] = model[name]
    return want
