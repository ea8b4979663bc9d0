"""Whether an evaluated model is published: the evaluate step's result, the gate, the baseline a
published model's card records, and the files and card entries the evaluation leaves.

The gate (``evaluate.gate``) compares one figure of the model (``neuron_parallel.evaluate``
measures them) with its baseline: the base model measured the same way in the same step, or the
figure the card of the model published at ``hub.repo_id`` records (its ``model-index``, as
:func:`card_eval_results` writes it). A figure lm-eval declares lower-is-better, and the eval
loss, improves downwards, the rest upwards; the improvement is relative to the baseline's
magnitude and must reach ``evaluate.gate.min_improvement``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .eval_loss import Objective
from .evaluate import EVAL_LOSS, EvaluateConfig, GateConfig, LmEvalTasks, Measured, measure, reference_logps
from .run_files import BASELINE_GENERATIONS_FILE, EVALUATION_FILE, GENERATIONS_FILE

LM_EVAL_SOURCE = {
    "source_name": "lm-evaluation-harness",
    "source_url": "https://github.com/EleutherAI/lm-evaluation-harness",
}
"""Where the card says an lm-eval figure comes from."""


@dataclass(frozen=True)
class Evaluation:
    """What the evaluate step found: the figures of the model and of its baseline, the
    generations, and whether the model is published (``promoted``) and why."""

    model_dir: str
    """The directory evaluated (the model the upload would publish)."""
    model: dict[str, float]
    baseline: dict[str, float]
    promoted: bool
    reason: str
    generations: list[dict] = field(default_factory=list)
    baseline_generations: list[dict] | None = None
    baseline_kind: str | None = None
    """What the baseline is: base (the base model) or hub (the published model's card)."""
    lineage: dict | None = None
    """The run's record of what it trained on (``neuron_parallel.lineage``), where the run has one."""

    def to_json(self) -> dict:
        """``evaluation.json``'s content."""
        out = {"model": self.model, "baseline": self.baseline, "promoted": self.promoted, "reason": self.reason}
        if self.lineage:
            out["lineage"] = self.lineage
        return out


def improvement(value: float, baseline: float, *, higher_is_better: bool) -> float:
    """The relative improvement of ``value`` over ``baseline`` (positive: better): the difference
    in the figure's better direction over the baseline's magnitude; ±inf (0 when equal) against
    a baseline of 0."""
    gain = value - baseline if higher_is_better else baseline - value
    if baseline == 0:
        return 0.0 if gain == 0 else math.copysign(math.inf, gain)
    return gain / abs(baseline)


def decide(
    gate: GateConfig | None, model: Measured, baseline: dict[str, float], *, baseline_name: str
) -> tuple[bool, str]:
    """``(promoted, reason)``: whether ``model`` meets ``gate`` against ``baseline``'s figures."""
    if gate is None:
        return True, "no gate configured (evaluate.gate): every model is published"
    metric = gate.metric
    if metric not in model.figures:
        produced = ", ".join(sorted(model.figures)) or "no figure"
        raise ValueError(
            f"evaluate.gate.metric={metric!r}: the evaluation produced {produced}; gate on one of those, or add the "
            "evaluation that produces it"
        )
    value = model.figures[metric]
    if metric not in baseline:
        return True, f"{metric} {value:.6g}; {baseline_name} records no {metric} to compare with: published"
    base = baseline[metric]
    gain = improvement(value, base, higher_is_better=model.higher_is_better.get(metric, True))
    direction = "lower" if not model.higher_is_better.get(metric, True) else "higher"
    verdict = "meets" if gain >= gate.min_improvement else "misses"
    reason = (
        f"{metric} {value:.6g} vs {base:.6g} of {baseline_name} ({direction} is better): {gain:+.2%} relative, "
        f"{verdict} evaluate.gate.min_improvement={gate.min_improvement:+.2%}"
    )
    return gain >= gate.min_improvement, reason


def published_figures(repo_id: str, *, endpoint: str | None, token: str | None) -> dict[str, float] | None:
    """The eval results the model card published at ``repo_id`` records, by ``<task>/<metric>``
    name (the card's ``metric_name``, as :func:`card_eval_results` writes it); None when nothing
    is published there yet (no repo, no card)."""
    import tempfile

    from huggingface_hub import HfApi, ModelCard
    from huggingface_hub.errors import EntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    with tempfile.TemporaryDirectory() as cache:
        try:
            path = HfApi(endpoint=endpoint, token=token).hf_hub_download(repo_id, "README.md", cache_dir=cache)
        except (RepositoryNotFoundError, RevisionNotFoundError, EntryNotFoundError):
            return None
        results = ModelCard.load(path, ignore_metadata_errors=True).data.eval_results or []
    return {r.metric_name or f"{r.dataset_type}/{r.metric_type}": float(r.metric_value) for r in results}


def evaluate_model(
    model_dir: str | Path,
    spec: EvaluateConfig,
    *,
    base_model_dir: str,
    device: str,
    precision: str,
    eval_path: str | None,
    template: Callable[[Any], str | None],
    objective: str = "sft",
    preference: Any = None,
    hub: tuple[str, str | None, str | None] | None = None,
    log: Callable[[str], None] = print,
) -> Evaluation:
    """Measure the model of ``model_dir`` (:func:`measure`; nothing is loaded when there is
    nothing to measure; the eval loss by the run's ``objective`` and ``preference`` settings, a
    dpo reference being the base model) and, with a gate, its baseline: the base model at
    ``base_model_dir`` measured the same way, or the figures the card published at ``hub`` =
    ``(repo_id, endpoint, token)`` records; then decide the gate."""
    tasks = LmEvalTasks(spec.lm_eval_tasks) if spec.lm_eval_tasks else None
    loss = Objective(objective, preference)
    if objective == "dpo" and eval_path:
        loss = Objective(objective, preference, reference_logps(base_model_dir, eval_path, device=device))
    how = dict(device=device, precision=precision, eval_path=eval_path, template=template, tasks=tasks, log=log)
    how["objective"] = loss
    wanted = eval_path or spec.prompts or tasks is not None
    model = measure(model_dir, spec, base_dir=base_model_dir, **how) if wanted else Measured({}, {}, [])
    gate = spec.gate
    baseline: dict[str, float] = {}
    baseline_generations, name = None, ""
    if gate is not None and gate.baseline == "base":
        base = measure(base_model_dir, spec, **how)
        baseline, name = base.figures, "the base model"
        baseline_generations = base.generations if spec.prompts else None
    elif gate is not None:
        if hub is None:
            raise ValueError("evaluate.gate.baseline=hub needs hub.repo_id; set it, or evaluate.gate.baseline: base")
        repo_id, endpoint, token = hub
        found = published_figures(repo_id, endpoint=endpoint, token=token)
        baseline = found or {}
        name = f"the model published at {repo_id}" + (" (nothing published yet)" if found is None else "")
    promoted, reason = decide(gate, model, baseline, baseline_name=name)
    return Evaluation(
        model_dir=str(model_dir),
        model=model.figures,
        baseline=baseline,
        promoted=promoted,
        reason=reason,
        generations=model.generations,
        baseline_generations=baseline_generations,
        baseline_kind=gate.baseline if gate is not None else None,
    )


def card_eval_results(evaluation: Evaluation, *, model_name: str, dataset: str) -> tuple[str, list]:
    """The model card's ``model-index`` for ``evaluation``'s figures (huggingface_hub
    ``EvalResult``s, ``metric_name`` the figure's key): ``(model_name, results)``; the eval loss is
    on ``dataset``, an lm-eval figure on its task."""
    from huggingface_hub import EvalResult

    results = []
    for key, value in evaluation.model.items():
        task, _, metric = key.partition("/")
        on = dataset if key == EVAL_LOSS else task
        kind = "loss" if key == EVAL_LOSS else metric
        source = {} if key == EVAL_LOSS else LM_EVAL_SOURCE
        results.append(
            EvalResult(
                task_type="text-generation",
                dataset_type=on,
                dataset_name=on,
                metric_type=kind,
                metric_name=key,
                metric_value=value,
                **source,
            )
        )
    return model_name, results


def write_evaluation(out_dir: str | Path, evaluation: Evaluation) -> None:
    """``evaluation.json`` in ``out_dir``, and with prompts ``generations.jsonl`` and (when the
    baseline generated) ``generations_baseline.jsonl``; each written whole or not at all."""
    from .utils import atomic_write

    def jsonl(rows: list[dict]) -> str:
        return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)

    out = Path(out_dir)
    atomic_write(out / EVALUATION_FILE, json.dumps(evaluation.to_json(), indent=2) + "\n")
    if evaluation.generations:
        atomic_write(out / GENERATIONS_FILE, jsonl(evaluation.generations))
    if evaluation.baseline_generations is not None:
        atomic_write(out / BASELINE_GENERATIONS_FILE, jsonl(evaluation.baseline_generations))


def generations_markdown(generations: list[dict], baseline: list[dict] | None = None) -> str:
    """The generations as a markdown table (TensorBoard's text, MLflow's artifact): the prompt
    (a conversation by its last message), the completion, and the baseline's where it generated."""

    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", "<br>")

    head = "| prompt | completion |" + (" baseline |" if baseline else "")
    lines = [head, "|---|---|" + ("---|" if baseline else "")]
    for n, g in enumerate(generations):
        row = f"| {cell(prompt_text(g['prompt']))} | {cell(g['completion'])} |"
        lines.append(row + (f" {cell(baseline[n]['completion'])} |" if baseline else ""))
    return "\n".join(lines) + "\n"


def prompt_text(prompt: str | list[dict]) -> str:
    """A prompt as one line of text: a conversation by its last message's content."""
    return prompt if isinstance(prompt, str) else prompt[-1]["content"]
