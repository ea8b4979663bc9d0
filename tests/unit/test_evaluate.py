"""The evaluate step's pieces that need no trained model: the gate's arithmetic, the prompts file,
local lm-eval tasks as lm-eval indexes them, the card's eval results as huggingface_hub reads
them back, and the figures and generations as TensorBoard and MLflow read them back."""

from __future__ import annotations

import json
import math

import pytest
from huggingface_hub import ModelCard

from neuron_parallel.evaluate import EvaluateConfig, GateConfig, LmEvalTasks, Measured, read_prompts
from neuron_parallel.hub import write_model_card
from neuron_parallel.promotion import Evaluation, decide, improvement

MC_TASK = """\
task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
"""


def _measured(**figures: float) -> Measured:
    return Measured(figures, {"eval_loss": False, "mc/acc": True, "mc/ppl": False}, [])


def test_the_gate_compares_in_each_figures_direction_relative_to_the_baseline():
    assert improvement(2.0, 4.0, higher_is_better=False) == 0.5
    assert improvement(0.3, 0.2, higher_is_better=True) == pytest.approx(0.5)
    assert improvement(0.1, 0.2, higher_is_better=True) == pytest.approx(-0.5)
    assert improvement(1.0, 0.0, higher_is_better=True) == math.inf
    assert improvement(0.0, 0.0, higher_is_better=True) == 0.0

    loss = GateConfig(metric="eval_loss", min_improvement=0.1)
    assert decide(loss, _measured(eval_loss=2.0), {"eval_loss": 2.5}, baseline_name="the base model")[0]
    promoted, reason = decide(loss, _measured(eval_loss=2.4), {"eval_loss": 2.5}, baseline_name="the base model")
    assert not promoted and "+4.00% relative, misses evaluate.gate.min_improvement=+10.00%" in reason
    regression = GateConfig(metric="mc/acc", min_improvement=-0.2)  # a bounded regression is allowed
    assert decide(regression, _measured(**{"mc/acc": 0.45}), {"mc/acc": 0.5}, baseline_name="b")[0]
    assert not decide(regression, _measured(**{"mc/acc": 0.35}), {"mc/acc": 0.5}, baseline_name="b")[0]
    # Equal is not worse: min_improvement 0 publishes it.
    assert decide(GateConfig(metric="mc/ppl"), _measured(**{"mc/ppl": 3.0}), {"mc/ppl": 3.0}, baseline_name="b")[0]


def test_without_a_baseline_figure_the_model_is_published_and_a_missing_figure_is_refused():
    gate = GateConfig(metric="eval_loss", baseline="hub")
    promoted, reason = decide(gate, _measured(eval_loss=2.0), {}, baseline_name="the model published at u/m")
    assert promoted and "records no eval_loss" in reason
    assert decide(None, _measured(), {}, baseline_name="")[0]
    with pytest.raises(ValueError, match=r"evaluate.gate.metric='mc/acc': the evaluation produced eval_loss"):
        decide(GateConfig(metric="mc/acc"), _measured(eval_loss=2.0), {}, baseline_name="b")


def test_prompt_rows_are_strings_or_conversations_and_others_are_refused(tmp_path):
    path = tmp_path / "p.jsonl"
    chat = [{"role": "user", "content": "hi"}]
    path.write_text(json.dumps({"prompt": "The for"}) + "\n\n" + json.dumps({"messages": chat}) + "\n")
    assert read_prompts(path) == ["The for", chat]
    path.write_text(json.dumps({"text": "no"}) + "\n")
    with pytest.raises(ValueError, match=r"line 1 has neither a string prompt nor messages"):
        read_prompts(path)
    path.write_text(json.dumps({"messages": [{"role": "bot", "content": "x"}]}) + "\n")
    with pytest.raises(ValueError, match=r"line 1: message 0 has role 'bot'"):
        read_prompts(path)
    with pytest.raises(ValueError, match=r"evaluate.prompts=.* is not a file"):
        EvaluateConfig(prompts=str(tmp_path / "gone.jsonl"))


def test_local_lm_eval_tasks_and_the_figures_they_produce(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"question": "q", "choices": ["a", "b"], "label": 0}) + "\n")
    folder = tmp_path / "tasks"
    folder.mkdir()
    (folder / "one.yaml").write_text(MC_TASK.format(name="mc_one", data=data))
    (folder / "two.yaml").write_text(MC_TASK.format(name="mc_two", data=data) + "metric_list:\n  - metric: acc\n")
    single = tmp_path / "three.yaml"
    single.write_text(MC_TASK.format(name="mc_three", data=data))

    tasks = LmEvalTasks([str(folder), str(single)])
    assert tasks.specs == ["mc_one", "mc_two", str(single)]
    # lm-eval's defaults for a multiple-choice task without a metric list: acc and acc_norm.
    assert tasks.figures() == {"mc_one/acc", "mc_one/acc_norm", "mc_two/acc", "mc_three/acc", "mc_three/acc_norm"}
    tasks.check_figure("mc_two/acc")
    with pytest.raises(ValueError, match=r"evaluate.gate.metric='mc_two/acc_norm' is produced by no task"):
        tasks.check_figure("mc_two/acc_norm")
    (tmp_path / "notes.yaml").write_text("just: notes\n")
    with pytest.raises(ValueError, match=r"notes.yaml is not an lm-eval task YAML file"):
        LmEvalTasks([str(tmp_path / "notes.yaml")])
    with pytest.raises(ValueError, match=r"tasks/gone.yaml is not a file or folder"):
        LmEvalTasks([str(folder / "gone.yaml")])


def test_the_card_records_the_figures_as_eval_results_and_shows_the_generations(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama"}))
    evaluation = Evaluation(
        model_dir=str(model),
        model={"eval_loss": 2.3456789, "mc/acc": 0.75},
        baseline={"eval_loss": 3.1, "mc/acc": 0.5},
        promoted=True,
        reason="eval_loss 2.34568 vs 3.1 of the base model",
        generations=[{"prompt": [{"role": "user", "content": "Say | hi"}], "completion": " hello\nthere"}],
        baseline_kind="base",
    )
    write_model_card(
        model, repo_id="u/tiny-ft", base_model="org/base", datasets=["org/data"], summary={}, evaluation=evaluation
    )
    card = ModelCard.load(model / "README.md")
    results = {r.metric_name: (r.metric_value, r.dataset_name, r.metric_type) for r in card.data.eval_results}
    assert results == {"eval_loss": (2.3456789, "org/data", "loss"), "mc/acc": (0.75, "mc", "acc")}
    assert card.data.model_name == "tiny-ft"
    assert "| eval_loss | 2.346 | 3.1 |" in card.text and "Gate (promoted): eval_loss 2.34568" in card.text
    assert "| Say \\| hi |  hello there |" in card.text


def test_the_figures_and_generations_reach_tensorboard_and_mlflow(tmp_path):
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from neuron_parallel.reporting import report_evaluation
    from neuron_parallel.run_files import MLFLOW_RUN_FILE, TENSORBOARD_DIR

    figures = {"eval_loss": 2.5, "gsm8k/exact_match,strict-match": 0.25}
    texts = {"evaluate/generations": "| prompt | completion |\n|---|---|\n| a | b |\n"}
    report_evaluation(tmp_path, ["tensorboard", "mlflow"], step=7, figures=figures, texts=texts)

    acc = EventAccumulator(str(tmp_path / TENSORBOARD_DIR), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("evaluate/eval_loss")] == [(7, 2.5)]
    shown = acc.Tensors("evaluate/generations/text_summary")
    assert shown[0].step == 7 and b"| a | b |" in shown[0].tensor_proto.string_val[0]

    saved = json.loads((tmp_path / MLFLOW_RUN_FILE).read_text())
    client = MlflowClient(saved["tracking_uri"])
    history = client.get_metric_history(saved["run_id"], "evaluate/gsm8k/exact_match_strict-match")
    assert [(m.step, m.value) for m in history] == [(7, 0.25)]
    local = client.download_artifacts(saved["run_id"], "evaluate/generations.md", str(tmp_path / "down"))
    assert open(local).read() == texts["evaluate/generations"]
