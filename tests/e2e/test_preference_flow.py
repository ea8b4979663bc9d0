"""DPO through the whole pipeline: configs/tiny-dpo-cpu.yaml as a Prefect flow on a real local
Prefect server (tokenize → reference → plan → train → validate → consolidate → evaluate → upload
step without a repo → report), its evaluation checked independently of the project's code.

The SFT flow (tests/e2e/test_flow.py) and the DPO engine's parity and learning runs
(tests/dist/test_preference.py) cover these steps in the fast tier; this run is the slow tier's
check that they compose for a preference objective."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import pytest
import torch

from ..conftest import ROOT, read_metrics
from .cli_helpers import run_cli as _cli

CONFIG = ROOT / "configs" / "tiny-dpo-cpu.yaml"
EVAL_PAIRS = 24


def _split(source: str, d: Path) -> tuple[str, str, list[dict]]:
    """The generated pairs as a training file and an eval file of the last ``EVAL_PAIRS`` pairs
    (``data.eval_source``, so that the eval pairs are known here without the project's split)."""
    pairs = [json.loads(line) for line in Path(source).read_text().splitlines() if line.strip()]
    train, held = pairs[:-EVAL_PAIRS], pairs[-EVAL_PAIRS:]
    d.mkdir(parents=True)
    for name, rows in (("train", train), ("eval", held)):
        (d / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(d / "train.jsonl"), str(d / "eval.jsonl"), held


def _completion_logps(model, tok, pairs: list[dict], block_size: int) -> list[tuple[float, float]]:
    """Each pair's summed log-probability of its chosen and its rejected completion under
    ``model``, the pair tokenized by TRL's ``tokenize_row`` rule (BOS + the prompt's ids, the
    completion's ids + EOS, each text tokenized alone without special tokens), one plain
    transformers forward per completion."""

    def ids(text: str) -> list[int]:
        return tok(text, add_special_tokens=False)["input_ids"]

    bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
    out = []
    for pair in pairs:
        prompt = bos + ids(pair["prompt"])
        sums = []
        for side in ("chosen", "rejected"):
            completion = ids(pair[side]) + [tok.eos_token_id]
            seq = torch.tensor([prompt + completion])
            with torch.no_grad():
                logps = model(input_ids=seq).logits[0, :-1].float().log_softmax(-1)
            taken = logps.gather(-1, seq[0, 1:, None])[-len(completion) :, 0]
            sums.append(taken.double().sum().item())
        pair_tokens = 2 * len(prompt) + len(ids(pair["chosen"])) + len(ids(pair["rejected"])) + 2
        assert pair_tokens <= block_size, "a pair the rows truncate: this check computes whole pairs only"
        out.append((sums[0], sums[1]))
    return out


@pytest.mark.slow
def test_the_dpo_flow_learns_and_evaluates_to_the_dpo_loss_of_plain_transformers(prefect_server, tiny_world, tmp_path):
    from huggingface_hub import ModelCard
    from prefect.client.orchestration import get_client
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from neuron_flows.flows.finetune import finetune
    from neuron_flows.tasks.config import FinetuneConfig

    train_file, eval_file, held = _split(tiny_world["preference"], tmp_path / "data")
    config = FinetuneConfig.load(
        str(CONFIG),
        [
            f"model.name_or_path={tiny_world['model']}",
            f"data.source={train_file}",
            f"data.eval_source={eval_file}",
            "data.eval_fraction=0",
            f"data.cache_dir={tmp_path / 'datasets'}",
            f"output.dir={tmp_path / 'run'}",
        ],
    )
    state = finetune(config, return_state=True)
    assert state.is_completed(), state
    result = state.result()
    run = Path(result["run_dir"])
    assert result["promoted"] and result["hub_url"] is None and result["final_step"] == config.train.max_steps

    async def task_names():
        async with get_client() as client:
            runs = await client.read_task_runs()
            return {r.name.rsplit("-", 1)[0] for r in runs if r.flow_run_id == state.state_details.flow_run_id}

    steps = {"tokenize", "reference", "plan", "train", "validate", "consolidate", "evaluate", "upload", "report"}
    assert steps <= asyncio.run(task_names())

    # The policy starts as its reference (loss ln 2, no reward) and learns the preference: the
    # chosen answer is one fixed short sentence, the rejected one random words.
    metrics = read_metrics(run)
    assert abs(metrics[0]["loss"] - math.log(2)) < 1e-6 and abs(metrics[0]["rewards_margin"]) < 1e-6
    final = metrics[-1]
    assert final["rewards_accuracy"] >= 0.9 and final["eval_rewards_accuracy"] >= 0.9, final
    assert final["eval_loss"] < math.log(2) and final["eval_pairs"] == EVAL_PAIRS

    # The evaluate step's eval loss (the consolidated model against the base, apart from the
    # engine) is the engine's after the last step; and it is the DPO loss that plain transformers
    # computes on the consolidated and the base model, over every eval pair.
    evaluation = json.loads((run / "evaluation.json").read_text())
    figure = evaluation["model"]["eval_loss"]
    assert abs(figure - final["eval_loss"]) <= 1e-5 * final["eval_loss"]
    consolidated = Path(result["consolidated"])
    tok = AutoTokenizer.from_pretrained(consolidated)
    policy = _completion_logps(AutoModelForCausalLM.from_pretrained(consolidated), tok, held, config.data.block_size)
    base = _completion_logps(
        AutoModelForCausalLM.from_pretrained(tiny_world["model"]), tok, held, config.data.block_size
    )
    beta = config.train.preference.beta
    losses = [
        -math.log(1 / (1 + math.exp(-beta * ((pc - rc) - (pr - rr))))) for (pc, pr), (rc, rr) in zip(policy, base)
    ]
    independent = sum(losses) / len(losses)
    print(f"DPO eval loss: engine {final['eval_loss']!r}, evaluate step {figure!r}, transformers {independent!r}")
    assert abs(figure - independent) <= 1e-3 * independent
    assert abs(final["eval_loss"] - independent) <= 1e-3 * independent

    # `neuron-flows evaluate` of the consolidated model with the run's config gives the same figure.
    sets = [f"{k}={v}" for k, v in (("model.name_or_path", tiny_world["model"]), ("output.dir", tmp_path / "alone"))]
    sets += [f"data.source={train_file}", f"data.eval_source={eval_file}", "data.eval_fraction=0"]
    sets += [f"data.cache_dir={tmp_path / 'datasets'}"]
    code, out = _cli("evaluate", str(consolidated), "--config", str(CONFIG), *(x for s in sets for x in ("--set", s)))
    assert code == 0, out[-3000:]
    alone = json.loads((tmp_path / "alone" / "evaluation.json").read_text())["model"]["eval_loss"]
    assert abs(alone - figure) <= 1e-7 * figure

    # The model card shows the objective and its reward figures.
    card = ModelCard.load(consolidated / "README.md")
    assert "| objective | dpo (sigmoid, beta=0.1, label_smoothing=0) |" in card.text
    assert f"| eval rewards_accuracy | {round(final['eval_rewards_accuracy'], 4):.4g} |" in card.text
    assert f"| final rewards_margin | {round(final['rewards_margin'], 4):.4g} |" in card.text
