"""The evaluate step between consolidation and upload, through `neuron-flows run` and `neuron-flows
evaluate` (the CLI's entry point, in this process) on a real local Prefect server, uploading to the
local Hub stand-in. One chat fine-tune of the tiny Llama (2 ranks, eval rows held out, prompts, a
local multiple-choice lm-eval task), gated on its eval loss against the base model: first with a
gate it misses (exit 3, nothing uploaded), then the same run with one it meets, which finds the
training done and publishes. The figures are checked against what the training engine, transformers
and lm-eval compute on the consolidated model themselves."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from ..conftest import HUB_PORT, ROOT, read_metrics
from ..hub_server import LocalHub
from .cli_helpers import run_cli as _cli

CONFIG = ROOT / "configs" / "tiny-chat-cpu.yaml"
REPO = "gated-tiny-chat"
QUESTIONS = [
    ("The for statement", [" iterates over a sequence", " is a colour", " rains"], 0),
    ("A Python list is", [" a mountain", " a mutable sequence", " a fish"], 1),
    ("The def keyword", [" paints", " swims", " defines a function"], 2),
    ("A dictionary maps", [" keys to values", " rivers to seas", " cats to dogs"], 0),
]
CHAT_PROMPT = [{"role": "user", "content": "Tell me more about nonlocal."}]


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    with LocalHub(tmp_path_factory.mktemp("hub"), port=HUB_PORT) as server:
        yield server


def _sets(values: dict) -> list[str]:
    return [x for k, v in values.items() for x in ("--set", f"{k}={json.dumps(v) if isinstance(v, dict) else v}")]


def _mc_task(d: Path) -> Path:
    """A local lm-eval multiple-choice task, its data in a JSONL file beside it."""
    data = d / "mc.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "label": a}) + "\n" for q, c, a in QUESTIONS))
    task = {
        "task": "tiny_mc",
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data)}},
        "test_split": "test",
        "output_type": "multiple_choice",
        "doc_to_text": "{{question}}",
        "doc_to_choice": "{{choices}}",
        "doc_to_target": "label",
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
    }
    (d / "mc.yaml").write_text(yaml.safe_dump(task))
    return d / "mc.yaml"


@pytest.fixture(scope="module")
def runs(prefect_server, tiny_world, hub, tmp_path_factory):
    """The run with a gate it misses, then the same run with one it meets."""
    d = tmp_path_factory.mktemp("gated")
    prompts = d / "prompts.jsonl"
    rows = ({"prompt": "The for statement"}, {"messages": CHAT_PROMPT})
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))
    sets = {
        "model.name_or_path": tiny_world["model"],
        "data.source": tiny_world["chat"],
        "data.chat_template": Path(tiny_world["chat_templates"]) / "llama3.jinja",
        "data.cache_dir": d / "datasets",
        "train.max_steps": 4,
        "train.eval_every": 0,
        "train.save_every": 0,
        "launch.nproc_per_node": 2,
        "output.dir": d / "run",
        "hub.repo_id": f"{hub.user}/{REPO}",
        "hub.endpoint": hub.url,
        "evaluate.prompts": prompts,
        "evaluate.max_new_tokens": 8,
        "evaluate.lm_eval_tasks": f"[{_mc_task(d)}]",
    }
    gate = {"metric": "eval_loss", "baseline": "base"}
    run = d / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_TOKEN", hub.token)
        missed = _cli("run", str(CONFIG), *_sets({**sets, "evaluate.gate": {**gate, "min_improvement": 0.95}}))
        after_missed = SimpleNamespace(
            evaluation=json.loads((run / "evaluation.json").read_text()),
            metrics=(run / "metrics.jsonl").read_bytes(),
            published=_published(hub),
            consolidated=sorted(p.name for p in d.iterdir() if p.name.startswith("run")),
            run_files=sorted(p.name for p in (run / "consolidated.staging" / "consolidated").iterdir()),
        )
        met = _cli("run", str(CONFIG), *_sets({**sets, "evaluate.gate": {**gate, "min_improvement": 0.0}}))
    return SimpleNamespace(d=d, run=run, sets=sets, missed=missed, met=met, after_missed=after_missed)


def _published(hub) -> bool:
    from huggingface_hub import HfApi

    return HfApi(endpoint=hub.url, token=hub.token).repo_exists(f"{hub.user}/{REPO}")


def _flow_runs_named(name: str) -> list:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterStateName

    async def read():
        async with get_client() as client:
            flt = FlowRunFilter(state=dict(name=FlowRunFilterStateName(any_=[name])))
            return await client.read_flow_runs(flow_run_filter=flt)

    return asyncio.run(read())


def test_a_gate_it_misses_uploads_nothing_and_exits_3(runs):
    code, out = runs.missed
    evaluation = runs.after_missed.evaluation
    assert code == 3, out[-3000:]
    assert out.splitlines()[-1] == f"not promoted: {evaluation['reason']}"
    assert evaluation["promoted"] is False and "misses evaluate.gate.min_improvement=+95.00%" in evaluation["reason"]
    assert evaluation["model"]["eval_loss"] < evaluation["baseline"]["eval_loss"]  # better, not 95% better
    assert not runs.after_missed.published
    # The model stays staged beside output.consolidated_dir, not put in place.
    assert runs.after_missed.consolidated == ["run"] and "model.safetensors" in runs.after_missed.run_files
    # The flow run ended Completed in the state NotPromoted, the reason as its message (what a
    # notification quotes).
    [state] = [r.state for r in _flow_runs_named("NotPromoted") if r.state.message == evaluation["reason"]]
    assert state.is_completed()


def test_the_same_run_with_a_gate_it_meets_publishes_the_figures_without_training_again(runs, hub, tmp_path):
    from huggingface_hub import HfApi, ModelCard

    code, out = runs.met
    assert code == 0, out[-3000:]
    evaluation = json.loads((runs.run / "evaluation.json").read_text())
    assert evaluation["promoted"] is True and "meets evaluate.gate.min_improvement=+0.00%" in evaluation["reason"]
    job = json.loads((runs.run / "job.json").read_text())
    assert evaluation["lineage"] == job["lineage"] and {"model", "data", "versions"} <= set(evaluation["lineage"])
    assert (runs.run / "metrics.jsonl").read_bytes() == runs.after_missed.metrics  # not trained again

    readme = HfApi(endpoint=hub.url, token=hub.token).hf_hub_download(
        f"{hub.user}/{REPO}", "README.md", cache_dir=tmp_path / "hf-cache"
    )
    card = ModelCard.load(readme)
    assert {r.metric_name: r.metric_value for r in card.data.eval_results} == evaluation["model"]
    assert set(evaluation["model"]) == {"eval_loss", "tiny_mc/acc"}
    generations = [json.loads(line) for line in (runs.run / "generations.jsonl").read_text().splitlines()]
    assert "## Evaluation" in card.text and generations[1]["completion"].strip() in card.text
    baseline = [json.loads(line) for line in (runs.run / "generations_baseline.jsonl").read_text().splitlines()]
    assert [g["prompt"] for g in baseline] == [g["prompt"] for g in generations] == ["The for statement", CHAT_PROMPT]

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.sorting import ArtifactSort

    async def newest():
        async with get_client() as client:
            return await client.read_artifacts(sort=ArtifactSort.CREATED_DESC, limit=20)

    arts = {}
    for a in asyncio.run(newest()):
        arts.setdefault(a.key, a)
    table = arts["generations"].data
    rows = json.loads(table) if isinstance(table, str) else table
    assert [r["completion"] for r in rows] == [g["completion"] for g in generations]
    assert arts["evaluation"].type == "table"


def test_the_figures_are_what_the_engine_transformers_and_lm_eval_compute(runs):
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from transformers import AutoModelForCausalLM, AutoTokenizer

    evaluation = json.loads((runs.run / "evaluation.json").read_text())
    # The eval loss, computed apart from the engine, is the engine's final one (2 dp ranks).
    engine = [m["eval_loss"] for m in read_metrics(runs.run) if "eval_loss" in m][-1]
    assert abs(evaluation["model"]["eval_loss"] - engine) <= 1e-5 * engine

    consolidated = runs.run / "consolidated"
    model = AutoModelForCausalLM.from_pretrained(consolidated)
    tok = AutoTokenizer.from_pretrained(consolidated)
    template = Path(runs.sets["data.chat_template"]).read_text()
    expected = []
    for prompt in ("The for statement", CHAT_PROMPT):
        if isinstance(prompt, str):
            enc = tok(prompt, return_tensors="pt")
        else:
            enc = tok.apply_chat_template(
                prompt, chat_template=template, add_generation_prompt=True, return_tensors="pt", return_dict=True
            )
        with torch.no_grad():
            ids = model.generate(**enc, do_sample=False, max_new_tokens=8)
        expected.append(tok.decode(ids[0, enc["input_ids"].shape[1] :], skip_special_tokens=True))
    generations = [json.loads(line) for line in (runs.run / "generations.jsonl").read_text().splitlines()]
    assert [g["completion"] for g in generations] == expected

    task = str(runs.d / "mc.yaml")
    lm = HFLM(pretrained=model, tokenizer=tok, device="cpu")
    out = simple_evaluate(lm, tasks=[task], task_manager=TaskManager(include_defaults=False))
    assert out["results"]["tiny_mc"]["acc,none"] == evaluation["model"]["tiny_mc/acc"]

    board = EventAccumulator(str(runs.run / "tensorboard"), size_guidance={"tensors": 0, "scalars": 0})
    board.Reload()
    texts = board.Tensors("evaluate/generations/text_summary")  # one per run, at its last step
    assert [t.step for t in texts] == [4, 4] and expected[0].strip().encode() in texts[-1].tensor_proto.string_val[0]


def test_evaluate_alone_gates_against_the_card_published_at_the_repo(runs, hub):
    """`neuron-flows evaluate` on the published model, against the figure its own card records:
    equal, so a gate of 0 is met and one of 1% is not."""
    alone = {**runs.sets, "output.dir": runs.d / "alone", "evaluate.lm_eval_tasks": "[]", "evaluate.prompts": "null"}
    gate = {"metric": "eval_loss", "baseline": "hub"}
    evaluate = ("evaluate", str(runs.run / "consolidated"), "--config", str(CONFIG))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_TOKEN", hub.token)
        code, out = _cli(*evaluate, *_sets({**alone, "evaluate.gate": gate}))
        assert code == 0, out[-3000:]
        assert "+0.00% relative, meets" in out
        stricter = {**gate, "min_improvement": 0.01}
        code, out = _cli(*evaluate, *_sets({**alone, "evaluate.gate": stricter}))
    assert code == 3, out[-3000:]
    saved = json.loads((runs.d / "alone" / "evaluation.json").read_text())
    assert out.splitlines()[-1] == f"not promoted: {saved['reason']}"
    # The baseline is every figure the card records, the eval loss the same as this one's.
    assert set(saved["baseline"]) == {"eval_loss", "tiny_mc/acc"} and set(saved["model"]) == {"eval_loss"}
    assert saved["baseline"]["eval_loss"] == saved["model"]["eval_loss"]
