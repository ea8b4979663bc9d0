"""What is published with the model holds no path of this machine: the model card (its body, its
training summary and the run's configuration) names a local model, dataset, template, cache or
run directory by its last component, and keeps Hub ids and URLs as they are."""

from __future__ import annotations

import json
import re

import yaml
from huggingface_hub import ModelCard

from neuron_flows.tasks.card import card_config, card_summary
from neuron_flows.tasks.config import FinetuneConfig
from neuron_parallel.config import ParallelConfig
from neuron_parallel.hub import card_data_table, write_model_card
from neuron_parallel.launch import TrainResult
from neuron_parallel.planning.layout import CheckedLayout

AUDIT = {"format": "chat", "packing": "documents", "examples": 10, "kept": 10, "tokens": 900, "rows": 4, "fill": 0.9}


def _local_world(tmp_path):
    """A run whose every path is absolute: model, data, template, cache, run and output folders,
    the checkpoint it resumed from and a hardware file."""
    for d in ("models/base-model", "data", "templates", "runs/old/checkpoint-4", "out/model-ft"):
        (tmp_path / d).mkdir(parents=True)
    (tmp_path / "models/base-model/config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "data/chats.jsonl").write_text('{"messages": []}\n')
    (tmp_path / "templates/chat.jinja").write_text("{{ messages }}")
    (tmp_path / "hw.yaml").write_text("name: mine\n")
    sets = {
        "model.name_or_path": tmp_path / "models/base-model",
        "data.format": "chat",
        "data.source": tmp_path / "data/chats.jsonl",
        "data.chat_template": tmp_path / "templates/chat.jinja",
        "data.cache_dir": tmp_path / "cache",
        "output.dir": tmp_path / "runs/new",
        "output.consolidated_dir": tmp_path / "out/model-ft",
        "train.resume_from": tmp_path / "runs/old/checkpoint-4",
        "launch.hardware": tmp_path / "hw.yaml",
        "launch.nproc_per_node": 4,
        "hub.endpoint": "https://huggingface.co",
    }
    return FinetuneConfig.load(None, [f"{k}={v}" for k, v in sets.items()])


def _card(config: FinetuneConfig, repo_id: str | None) -> str:
    """The card's text as the Hub would serve it."""
    layout = CheckedLayout(ParallelConfig(dp=2, tp=2, pp=1), 4, 16, 1000, [4], micro_batch_size=2, grad_accum=4)
    result = TrainResult(run_dir=config.output.dir, final_step=7, resumed_from_step=4, last_metrics={"loss": 2.0})
    sources = [config.data.source]
    path = write_model_card(
        config.output.consolidated_dir,
        repo_id=repo_id,
        base_model=config.model.name_or_path,
        datasets=sources,
        summary=card_summary(config, result, layout),
        data=card_data_table(AUDIT, sources=sources, block_size=64),
        config=card_config(config, layout),
    )
    return ModelCard.load(path).content


def test_no_absolute_path_in_the_model_card(tmp_path):
    config = _local_world(tmp_path)
    (tmp_path / "out/model-ft/config.json").write_text(json.dumps({"model_type": "llama"}))
    for repo_id in ("org/llama-ft", None):
        text = _card(config, repo_id)
        assert str(tmp_path) not in text and str(tmp_path.resolve()) not in text, text
        # No absolute path of any kind: a '/' that starts a path, after a space, a quote or '('.
        assert not re.search(r"""[\s"'`(]/\w""", text), re.search(r""".{40}[\s"'`(]/\w.{40}""", text)
        shown = yaml.safe_load(re.search(r"```yaml\n(.*?)```", text, re.S).group(1))
        assert shown["model"]["name_or_path"] == "base-model"
        assert shown["data"]["source"] == "chats.jsonl" and shown["data"]["chat_template"] == "chat.jinja"
        assert shown["data"]["cache_dir"] == "cache" and shown["train"]["resume_from"] is None
        assert (shown["output"]["dir"], shown["output"]["consolidated_dir"]) == ("new", "model-ft")
        assert shown["launch"]["hardware"] == "hw.yaml" and "| hardware | hw.yaml: 1 node(s)" in text
        assert shown["hub"]["endpoint"] == "https://huggingface.co"  # a URL, not a local path: kept
        assert "a local checkpoint (`base-model`)" in text and "a local dataset (`chats.jsonl`)" in text
    assert 'from_pretrained("path/to/model-ft")' in text  # no repo id yet: the folder by its name
