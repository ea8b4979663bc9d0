"""LoRA checkpoints out: the peft adapter export loads with peft and computes what the training
model computes, and ``--merge`` equals peft's ``merge_and_unload``, tensor by tensor. Adapters come
from real torchrun runs with non-zero B: tp2 on the tiny Llama (modules_to_save lm_head) and one
rank on the tied Qwen2 (modules_to_save embed_tokens, qkv biases)."""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch

from neuron_flows.flows.cli import main as cli
from neuron_parallel.checkpoint import CheckpointTensors, HFWeights, export_checkpoint, validate_checkpoint
from neuron_parallel.checkpoint.hf_dir import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from neuron_parallel.checkpoint.output import OWNER_FILE
from neuron_parallel.config import LoraConfig
from neuron_parallel.models.causal_lm import CausalLMStage, build_meta_model, load_config, load_weights, materialize
from neuron_parallel.parallel.lora import add_lora, is_adapter

from ..conftest import torchrun, write_job

TRAIN = dict(max_steps=3, save_every=0, lr=1e-2, warmup_steps=0, seed=3, micro_batch_size=4)
RUNS = {
    # name: (tiny_world key, ranks, parallel, lora)
    "llama-tp2": ("model", 2, {"tp": 2}, LoraConfig(r=4, alpha=8.0, dropout=0.1, modules_to_save=["lm_head"])),
    "qwen2-tied": ("qwen2", 1, {}, LoraConfig(r=2, alpha=4.0, modules_to_save=["embed_tokens"])),
}


@pytest.fixture(scope="module", params=sorted(RUNS))
def trained(request, tiny_world, tiny_dataset, tmp_path_factory):
    """(base model dir, checkpoint dir) of a short LoRA run."""
    key, ranks, parallel, lora = RUNS[request.param]
    run = tmp_path_factory.mktemp(request.param)
    train = dict(TRAIN, lora=lora)
    job = write_job(run, tiny_world[key], tiny_dataset.path, world=ranks, parallel=parallel, train=train)
    proc = torchrun(job, ranks)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    ckpt = run / f"checkpoint-{TRAIN['max_steps']}"
    b = CheckpointTensors(ckpt).read("model.layers.0.self_attn.q_proj.lora_B")
    assert b.abs().max() > 0  # trained: the adapters change the model
    return tiny_world[key], ckpt


def training_model(base_dir, ckpt) -> CausalLMStage:
    """Our stage as training builds it: adapters added on meta, base weights from the base model,
    adapters and modules to save from the checkpoint."""
    tensors = CheckpointTensors(ckpt)
    config = load_config(base_dir)
    stage = CausalLMStage(build_meta_model(config), range(config.num_hidden_layers), first=True, last=True)
    add_lora(stage, LoraConfig(**tensors.manifest.adapter["lora"]))
    materialize(stage, torch.device("cpu"))
    tied = bool(config.tie_word_embeddings)
    trained = set(tensors.names("model"))
    load_weights(stage, HFWeights(base_dir), tied=tied, skip=is_adapter)
    load_weights(stage, tensors, tied=tied, skip=lambda name: name not in trained)
    return stage.eval()


def load_base(base_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(base_dir, attn_implementation="sdpa", dtype=torch.float32).eval()


def load_peft(base_dir, adapter_dir):
    """PeftModel.from_pretrained, failing on any warning about keys."""
    from peft import PeftModel

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = PeftModel.from_pretrained(load_base(base_dir), adapter_dir)
    assert not [w for w in caught if "key" in str(w.message).lower()], [str(w.message) for w in caught]
    return model.eval()


def token_ids(vocab: int) -> torch.Tensor:
    return torch.randint(3, vocab, (2, 24), generator=torch.Generator().manual_seed(0))


@torch.no_grad()
def test_peft_loads_the_exported_adapter_and_computes_the_training_models_logits(trained, tmp_path):
    from peft.utils import get_peft_model_state_dict, load_peft_weights

    base_dir, ckpt = trained
    out = export_checkpoint(ckpt, tmp_path / "adapter")
    tokenizer = {"tokenizer.json", "tokenizer_config.json"}
    expected = {ADAPTER_CONFIG, ADAPTER_WEIGHTS, OWNER_FILE, *tokenizer}
    assert {p.name for p in out.iterdir()} - {"chat_template.jinja"} == expected
    model = load_peft(base_dir, out)
    # Every key peft's model has for this adapter is in the file, and nothing else, with our values.
    saved = load_peft_weights(str(out))
    expected = get_peft_model_state_dict(model)
    assert set(saved) == set(expected)
    for key, value in saved.items():
        assert torch.equal(expected[key], value), key
    lora = CheckpointTensors(ckpt).manifest.adapter["lora"]
    config = model.peft_config["default"]
    assert (config.r, config.lora_alpha, config.lora_dropout) == (lora["r"], lora["alpha"], lora["dropout"])
    assert config.target_modules == set(lora["target_modules"])

    ids = token_ids(model.config.vocab_size)
    ours = training_model(base_dir, ckpt)(ids)
    theirs = model(input_ids=ids).logits
    assert (ours - theirs).abs().max().item() <= 1e-5
    base = load_base(base_dir)(input_ids=ids).logits
    assert (base - theirs).abs().max().item() > 1e-3  # the comparison sees the adapters


@torch.no_grad()
def test_merge_equals_peft_merge_and_unload(trained, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    base_dir, ckpt = trained
    adapter = export_checkpoint(ckpt, tmp_path / "adapter")
    assert cli(["consolidate", str(ckpt), str(tmp_path / "merged"), "--merge"]) == 0
    merged_peft = load_peft(base_dir, adapter).merge_and_unload()
    reference = merged_peft.state_dict()
    ours = load_file(tmp_path / "merged" / "model.safetensors")
    assert set(ours) == set(load_file(f"{base_dir}/model.safetensors"))  # the base's tensors, no more
    assert set(ours) <= set(reference)
    for name, tensor in ours.items():
        assert tensor.dtype == reference[name].dtype
        assert (tensor - reference[name]).abs().max().item() <= 1e-6, name
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", attn_implementation="sdpa").eval()
    ids = token_ids(merged.config.vocab_size)
    assert (merged(input_ids=ids).logits - merged_peft(input_ids=ids).logits).abs().max().item() <= 1e-5
    assert (merged(input_ids=ids).logits - training_model(base_dir, ckpt)(ids)).abs().max().item() <= 1e-5


def test_validation_passes_and_flags_a_missing_or_stray_tensor(trained, tmp_path):
    _, ckpt = trained
    assert validate_checkpoint(ckpt) == []
    broken = tmp_path / ckpt.name
    shutil.copytree(ckpt, broken)
    manifest = json.loads((broken / "manifest.json").read_text())
    name = "model.layers.1.mlp.down_proj.lora_A"
    stray = "model.layers.0.input_layernorm.weight"
    manifest["tensors"][stray] = manifest["tensors"].pop(name)
    (broken / "manifest.json").write_text(json.dumps(manifest))
    problems = validate_checkpoint(broken)
    assert any(f"trainable tensor {name}" in p and "missing" in p for p in problems), problems
    assert any(stray in p and "not a trainable tensor" in p for p in problems), problems


def test_merge_refuses_another_base_and_a_full_checkpoint(trained, tmp_path, capsys):
    base_dir, ckpt = trained
    other = tmp_path / "other-base"
    shutil.copytree(base_dir, other)
    weights = other / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-4:] = bytes(4)  # one weight changed
    weights.write_bytes(bytes(data))
    assert cli(["consolidate", str(ckpt), str(tmp_path / "m"), "--merge", "--base-dir", str(other)]) == 2
    err = capsys.readouterr().err
    assert "holds other weights" in err and "--base-dir" in err and "Traceback" not in err
    assert not (tmp_path / "m").exists()

    full = tmp_path / "full" / ckpt.name  # the same files, with the manifest of a full fine-tuning run
    shutil.copytree(ckpt, full)
    manifest = json.loads((full / "manifest.json").read_text())
    manifest["adapter"] = None
    (full / "manifest.json").write_text(json.dumps(manifest))
    assert cli(["consolidate", str(full), str(tmp_path / "m"), "--merge"]) == 2
    err = capsys.readouterr().err
    assert "not a LoRA checkpoint" in err and "without --merge" in err
