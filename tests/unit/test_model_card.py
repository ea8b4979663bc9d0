"""The model card as huggingface_hub reads it back: metadata, loss curve, data, configuration."""

from __future__ import annotations

import json
import re

import pytest
import yaml
from huggingface_hub import ModelCard

from neuron_flows.tasks.card import card_config, card_summary
from neuron_flows.tasks.config import FinetuneConfig
from neuron_parallel.config import ParallelConfig
from neuron_parallel.hub import base_model_license, card_data_table, write_model_card
from neuron_parallel.launch import TrainResult
from neuron_parallel.planning.layout import CheckedLayout

AUDIT = {
    "format": "chat",
    "packing": "documents",
    "examples": 1200,
    "kept": 1190,
    "truncated": 7,
    "dropped": 10,
    "tokens": 250_000,
    "trained_tokens": 100_000,
    "trained_fraction": 0.4,
    "rows": 980,
    "fill": 0.9541,
    "eval_examples": 60,
    "eval_rows": 50,
}


@pytest.fixture
def model_dir(tmp_path):
    root = tmp_path / "model"
    root.mkdir()
    (root / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (root / "tokenizer.json").write_text("{}")
    (root / "loss_curve.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    return root


def layout() -> CheckedLayout:
    parallel = ParallelConfig(dp=2, tp=2, pp=1, zero_1=True, sequence_parallel=True)
    return CheckedLayout(parallel, 4, 16, 1000, [4], micro_batch_size=2, grad_accum=4)


def test_card_metadata_loss_curve_data_and_config_read_back(model_dir, tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    (base / "README.md").write_text("---\nlicense: llama3.1\n---\n# the base\n")
    config = {"model": {"name_or_path": "meta-llama/Llama-3.1-8B"}, "train": {"max_steps": 3, "lr": 0.0002}}
    sources = ["tatsu-lab/alpaca", str(tmp_path / "mine.jsonl")]
    path = write_model_card(
        model_dir,
        repo_id="org/llama-ft",
        base_model="meta-llama/Llama-3.1-8B",
        datasets=sources,
        summary={"steps": 3, "final loss": 1.25, "eval loss": 1.5},
        data=card_data_table(AUDIT, sources=sources, block_size=256),
        config=config,
        loss_curve="loss_curve.png",
        license=base_model_license(base),
    )
    card = ModelCard.load(path)
    assert card.data.base_model == "meta-llama/Llama-3.1-8B" and card.data.datasets == ["tatsu-lab/alpaca"]
    assert card.data.license == "llama3.1" and card.data.library_name == "transformers"
    assert {"neuron-flows", "fine-tuned"} <= set(card.data.tags)
    assert "![loss curve](loss_curve.png)" in card.text
    assert "| final loss | 1.25 |" in card.text and "| eval loss | 1.5 |" in card.text
    assert "| format | chat (documents packing) |" in card.text
    assert "| tokens | 250,000 (100,000 trained on, 40.0%) |" in card.text
    assert "| rows | 980 of 256 tokens (95.4% filled) |" in card.text
    assert "| eval | 60 examples in 50 rows |" in card.text
    assert "[tatsu-lab/alpaca](https://huggingface.co/datasets/tatsu-lab/alpaca), a local dataset (`mine.jsonl`)" in (
        card.text
    )
    block = re.search(r"```yaml\n(.*?)```", card.text, re.S)
    assert block and yaml.safe_load(block.group(1)) == config
    assert 'AutoModelForCausalLM.from_pretrained("org/llama-ft")' in card.text


def test_a_missing_loss_curve_and_a_base_without_license(model_dir, tmp_path):
    with pytest.raises(ValueError, match="loss_curve.svg does not exist"):
        write_model_card(model_dir, repo_id=None, base_model="b", datasets=[], summary={}, loss_curve="loss_curve.svg")
    assert base_model_license(tmp_path) is None
    card = ModelCard.load(write_model_card(model_dir, repo_id=None, base_model="org/b", datasets=[], summary={}))
    assert card.data.license is None and "## Configuration" not in card.text and "![loss curve]" not in card.text


def test_the_cards_configuration_is_a_config_that_runs_the_chosen_layout():
    config = FinetuneConfig.load(
        None, ["launch.nproc_per_node=4", "data.block_size=64", "train.max_steps=7", "hub.repo_id=org/ft"]
    )
    assert config.parallel.tp == "auto" and config.train.micro_batch_size == "auto"
    dumped = card_config(config, layout())
    again = FinetuneConfig.model_validate(yaml.safe_load(yaml.safe_dump(dumped)))
    assert again.parallel.tp == 2 and again.parallel.zero_1 is True and again.train.micro_batch_size == 2
    assert again.train.max_steps == 7 and again.hub.repo_id == "org/ft"
    assert config.parallel.mixed_precision == "auto" and again.parallel.mixed_precision == "fp32"  # what ran
    result = TrainResult(run_dir="r", final_step=7, resumed_from_step=0, last_metrics={"loss": 2.0, "tokens_seen": 99})
    summary = card_summary(config, result, layout())
    assert summary["layout"] == "tp=2 pp=1 dp=2 zero1 sp" and summary["steps"] == 7
    assert summary["hardware"] == "cpu: 1 node(s) × 4 cpu rank(s), fp32"
    assert summary["batch"] == "16 sequences of 64 tokens per step (micro batch 2 × accumulation 4 × dp 2)"


def test_a_preference_runs_card_shows_its_objective_and_reward_figures(model_dir):
    sets = ["launch.nproc_per_node=4", "data.block_size=64", "data.format=preference", "data.eval_fraction=0.1"]
    config = FinetuneConfig.load(None, [*sets, "train.objective=dpo", "train.preference.beta=0.2"])
    final = {"loss": 0.31, "rewards_accuracy": 0.9375, "rewards_margin": 1.23456, "rewards_chosen": 0.5}
    final |= {"rewards_rejected": -0.73456, "eval_loss": 0.35, "eval_rewards_accuracy": 0.875}
    final |= {"eval_rewards_margin": 1.1, "eval_rewards_chosen": 0.4, "eval_rewards_rejected": -0.7}
    result = TrainResult(run_dir="r", final_step=30, resumed_from_step=0, last_metrics=final)
    summary = card_summary(config, result, layout())
    card = ModelCard.load(write_model_card(model_dir, repo_id=None, base_model="org/b", datasets=[], summary=summary))
    assert "| objective | dpo (sigmoid, beta=0.2, label_smoothing=0) |" in card.text
    assert "| final loss | 0.31 |" in card.text and "| eval loss | 0.35 |" in card.text
    for label, prefix in (("final", ""), ("eval", "eval_")):
        for name in ("rewards_accuracy", "rewards_margin", "rewards_chosen", "rewards_rejected"):
            shown = f"{final[prefix + name]:.4g}"  # the card's cells show 4 significant digits
            assert f"| {label} {name} | {shown} |" in card.text, (label, name)
    orpo = FinetuneConfig.load(None, [*sets, "train.objective=orpo"])
    assert card_summary(orpo, result, layout())["objective"] == "orpo (beta (the odds-ratio weight λ)=0.1)"
    # A supervised run's card has none of these rows.
    sft = card_summary(FinetuneConfig.load(None, sets[:2]), result, layout())
    assert not {k for k in sft if "rewards" in k or k == "objective"}
