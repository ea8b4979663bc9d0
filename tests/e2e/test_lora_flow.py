"""configs/tiny-llama-lora-cpu.yaml through the whole flow on a real local Prefect server, uploading
to the local Hub stand-in: the repo holds the peft adapter (with the merged model in ``merged/``,
``hub.upload: both``), peft loads the downloaded adapter with every key, and the merged model
computes what the adapter on its base computes."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from neuron_flows.tasks.config import FinetuneConfig

from ..conftest import HUB_PORT, ROOT
from ..hub_server import LocalHub


@pytest.fixture
def hub(tmp_path):
    with LocalHub(tmp_path / "hub", port=HUB_PORT) as server:
        yield server


def test_lora_config_uploads_an_adapter_that_peft_loads(prefect_server, tiny_world, tmp_path, hub, monkeypatch):
    from huggingface_hub import ModelCard, snapshot_download
    from peft import PeftModel
    from peft.utils import get_peft_model_state_dict, load_peft_weights
    from transformers import AutoModelForCausalLM

    from neuron_flows.flows.finetune import finetune

    monkeypatch.setenv("HF_TOKEN", hub.token)
    repo = f"{hub.user}/tiny-llama-lora"
    sets = {
        "model.name_or_path": tiny_world["model"],
        "data.source": tiny_world["corpus"],
        "data.cache_dir": tmp_path / "datasets",
        "train.max_steps": 3,
        "train.save_every": 0,
        "output.dir": tmp_path / "run",
        "hub.repo_id": repo,
        "hub.endpoint": hub.url,
        "hub.upload": "both",
    }
    config = FinetuneConfig.load(ROOT / "configs/tiny-llama-lora-cpu.yaml", [f"{k}={v}" for k, v in sets.items()])
    assert config.train.lora is not None and config.parallel.tp == 2
    state = finetune(config, return_state=True)
    assert state.is_completed(), state
    result = state.result()
    assert result["hub_url"] and repo in result["hub_url"]

    snap = Path(snapshot_download(repo, endpoint=hub.url, token=hub.token, cache_dir=tmp_path / "hf-cache"))
    files = {p.relative_to(snap).as_posix() for p in snap.rglob("*") if p.is_file()}
    assert {"adapter_config.json", "adapter_model.safetensors", "README.md", "merged/model.safetensors"} <= files
    assert "model.safetensors" not in files and "config.json" not in files  # the root is the adapter
    # A published file names the local base model by its folder only (no path of this machine).
    base_name = json.loads((snap / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert base_name == Path(tiny_world["model"]).name
    here = (str(tmp_path), str(Path(tiny_world["model"]).parent))
    assert not [(p.name, x) for p in snap.rglob("*") if p.is_file() for x in here if x.encode() in p.read_bytes()]

    base = AutoModelForCausalLM.from_pretrained(tiny_world["model"], dtype=torch.float32).eval()
    ids = torch.randint(3, base.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base_logits = base(input_ids=ids).logits
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = PeftModel.from_pretrained(base, snap).eval()
    assert not [w for w in caught if "key" in str(w.message).lower()], [str(w.message) for w in caught]
    assert set(load_peft_weights(str(snap))) == set(get_peft_model_state_dict(model))
    # As the card says: without adapter_kwargs, transformers would find the root's adapter config.
    merged = AutoModelForCausalLM.from_pretrained(
        snap, subfolder="merged", adapter_kwargs={"subfolder": "merged"}, dtype=torch.float32
    ).eval()
    with torch.no_grad():
        adapted, merged_logits = model(input_ids=ids).logits, merged(input_ids=ids).logits
    assert (adapted - base_logits).abs().max().item() > 1e-3  # three steps moved the adapters
    assert (adapted - merged_logits).abs().max().item() <= 1e-5

    card = ModelCard.load(snap / "README.md")
    assert card.data.library_name == "peft" and "lora" in card.data.tags
    assert "LoRA adapter" in card.text and f"`{Path(tiny_world['model']).name}`" in card.text  # the base model
    assert 'subfolder="merged", adapter_kwargs={"subfolder": "merged"}' in card.text
