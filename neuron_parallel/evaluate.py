"""The evaluation of a consolidated model, between consolidation and upload: its config, the
checks of its inputs, and the measurements.

A model directory (a full model, a peft adapter on its base, or an adapter with its merged model
in ``merged/``) is loaded through transformers in fp32 on one device of the run's kind, apart
from the training engine, and measured three ways:

- **eval loss** (``eval_loss``): over the tokenized eval rows, with the run's loss rule
  (``neuron_parallel.eval_loss``: the mean over the labelled tokens, or for a preference objective
  the mean per-pair loss); it equals the engine's eval loss up to the order of fp32 sums;
- **generations**: greedy ``model.generate(..., do_sample=False, max_new_tokens=...)`` for each
  row of ``evaluate.prompts``, a ``{"prompt": str}`` tokenized as ``tokenizer(prompt)`` does, a
  ``{"messages": [...]}`` rendered with the run's chat template and the generation prompt; the
  completion is the new tokens decoded with ``skip_special_tokens=True``, unstripped;
- **lm-eval tasks**: ``lm_eval.simple_evaluate`` with an ``HFLM`` around the loaded model; each
  figure is keyed ``<task>/<metric>`` (lm-eval's ``,none`` filter suffix dropped, any other
  filter kept: ``gsm8k/exact_match,strict-match``).

The run's precision applies: under ``bf16`` the forward passes run in bf16 autocast on fp32
weights, as training does. Whether the model is then published is ``neuron_parallel.promotion``'s.
"""

from __future__ import annotations

import difflib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from .eval_loss import SFT, Objective, eval_loss, precision_context

Baseline = Literal["base", "hub"]
EVAL_LOSS = "eval_loss"
"""The figure of the held-out loss (``metrics.jsonl`` and the trainer name it the same)."""
LM_EVAL_BATCH = 8
"""Requests lm-eval scores per forward pass."""


@dataclass(kw_only=True, slots=True)
class GateConfig:
    """Whether the evaluated model is published: one figure against a baseline."""

    metric: str = EVAL_LOSS
    """The figure compared: eval_loss (needs eval rows), or an lm-eval figure <task>/<metric>
    (e.g. arc_easy/acc) of a task in evaluate.lm_eval_tasks. Losses improve downwards, the rest
    upwards (as lm-eval declares each metric)."""
    baseline: Baseline = "base"
    """base: the base model (model.name_or_path) evaluated the same way in the same step; hub: the
    figure in the eval results of the model card published at hub.repo_id (none published yet:
    the model is promoted)."""
    min_improvement: float = 0.0
    """Relative improvement over the baseline required to publish: 0 publishes a model at least
    as good, 0.05 one 5% better; a negative value allows a bounded regression."""

    def __post_init__(self) -> None:
        if self.baseline not in get_args(Baseline):
            raise ValueError(f"evaluate.gate.baseline={self.baseline!r} is not one of {get_args(Baseline)}")
        task, sep, metric = self.metric.partition("/")
        if self.metric != EVAL_LOSS and not (sep and task.strip() and metric.strip()):
            raise ValueError(
                f"evaluate.gate.metric={self.metric!r} is neither {EVAL_LOSS} nor an lm-eval figure <task>/<metric>; "
                f"write {EVAL_LOSS} or e.g. arc_easy/acc"
            )
        if not math.isfinite(self.min_improvement):
            raise ValueError(f"evaluate.gate.min_improvement must be a finite number, got {self.min_improvement}")


@dataclass(kw_only=True, slots=True)
class EvaluateConfig:
    """The evaluation of the consolidated model before it is uploaded: the eval loss over the eval
    rows (when the data has them), greedy generations and lm-eval tasks; with a gate, whether the
    model is published."""

    prompts: str | None = None
    """A JSONL file of {"prompt": str} or {"messages": [...]} rows; each gets a greedy
    generation of the consolidated model (chat rendered with the chat template and the
    generation prompt), in generations.jsonl, the model card, TensorBoard and MLflow."""
    max_new_tokens: int = 64
    """Tokens generated at most for each prompt."""
    lm_eval_tasks: list[str] = field(default_factory=list)
    """lm-evaluation-harness tasks run on the consolidated model: task names, or paths of local
    task YAML files or folders of them (needs lm-eval installed)."""
    lm_eval_limit: int | None = None
    """Examples of each lm-eval task at most; None runs them all."""
    gate: GateConfig | None = None
    """Publish only a model that meets this; None publishes every model."""

    def __post_init__(self) -> None:
        self.lm_eval_tasks = [self.lm_eval_tasks] if isinstance(self.lm_eval_tasks, str) else list(self.lm_eval_tasks)
        if isinstance(self.gate, dict):
            self.gate = GateConfig(**self.gate)
        if self.prompts is not None and not Path(self.prompts).expanduser().is_file():
            raise ValueError(
                f'evaluate.prompts={self.prompts!r} is not a file; give a JSONL file of {{"prompt": ...}} or '
                '{"messages": [...]} rows, or remove evaluate.prompts'
            )
        if self.max_new_tokens < 1:
            raise ValueError(f"evaluate.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.lm_eval_limit is not None and self.lm_eval_limit < 1:
            raise ValueError(f"evaluate.lm_eval_limit must be >= 1 (or unset: every example), got {self.lm_eval_limit}")
        if self.gate is not None and self.gate.metric != EVAL_LOSS and not self.lm_eval_tasks:
            raise ValueError(
                f"evaluate.gate.metric={self.gate.metric!r} is an lm-eval figure but evaluate.lm_eval_tasks is empty; "
                f"list its task there (e.g. [{self.gate.metric.partition('/')[0]}]) or gate on {EVAL_LOSS}"
            )


def check_gate(spec: EvaluateConfig, *, has_eval_rows: bool, hub_repo_id: str | None) -> None:
    """Refuse a gate the rest of the config cannot serve: ``eval_loss`` without eval rows, a
    ``hub`` baseline without a Hub repo."""
    gate = spec.gate
    if gate is None:
        return
    if gate.metric == EVAL_LOSS and not has_eval_rows:
        raise ValueError(
            f"evaluate.gate.metric={EVAL_LOSS} needs evaluation rows; set data.eval_fraction (e.g. 0.05), "
            "data.eval_split or data.eval_source, or gate on an lm-eval figure <task>/<metric>"
        )
    if gate.baseline == "hub" and not hub_repo_id:
        raise ValueError(
            "evaluate.gate.baseline=hub compares with the model published at hub.repo_id, which is not set; set "
            "hub.repo_id, or use evaluate.gate.baseline: base"
        )


# -- the inputs, checked before training ------------------------------------------------------


def read_prompts(path: str | Path) -> list[str | list[dict]]:
    """The rows of an ``evaluate.prompts`` file: a string per ``{"prompt"}`` row, the message list
    per ``{"messages"}`` row. Raises ValueError naming the row and the fix."""
    from .sft import check_messages

    fix = 'each line must be {"prompt": "..."} or {"messages": [{"role": ..., "content": ...}, ...]}'
    out: list[str | list[dict]] = []
    for n, line in enumerate(Path(path).expanduser().read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"evaluate.prompts={path} line {n}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where} is not JSON ({e.msg}); {fix}") from None
        if isinstance(row, dict) and isinstance(row.get("prompt"), str):
            out.append(row["prompt"])
        elif isinstance(row, dict) and "messages" in row:
            out.append(check_messages(row["messages"], where))
        else:
            raise ValueError(f"{where} has neither a string prompt nor messages; {fix}")
    if not out:
        raise ValueError(f"evaluate.prompts={path} has no rows; {fix}, or remove evaluate.prompts")
    return out


def check_inputs(spec: EvaluateConfig) -> None:
    """Refuse, before training, what the evaluation would fail on: a prompts file with a row of
    neither form, an lm-eval task lm-eval does not know (names as its ``TaskManager`` indexes them,
    local files and folders as it reads them), a gate figure that no configured task produces."""
    if spec.prompts is not None:
        read_prompts(spec.prompts)
    if spec.lm_eval_tasks:
        tasks = LmEvalTasks(spec.lm_eval_tasks)
        if spec.gate is not None and spec.gate.metric != EVAL_LOSS:
            tasks.check_figure(spec.gate.metric)


class LmEvalTasks:
    """``evaluate.lm_eval_tasks`` as lm-eval loads them: one ``TaskManager`` (lm-eval's own index
    only when a task is named, local folders added with ``include_path``) and the specs to load
    (names; a YAML file by its path). Raises ValueError for an entry lm-eval does not know."""

    def __init__(self, entries: list[str]) -> None:
        try:
            from lm_eval.tasks import TaskManager
        except ImportError:
            raise ValueError(
                "evaluate.lm_eval_tasks needs lm-eval, which is not installed; install it (pip install lm-eval) "
                "or empty evaluate.lm_eval_tasks"
            ) from None
        from lm_eval.tasks._index import Kind, TaskIndex
        from lm_eval.tasks._yaml_loader import load_yaml

        self.specs: list[str] = []
        self.configs: dict[str, dict | None] = {}
        """Each task to run by name: its YAML config (None where a group or tag stands for several)."""
        folders, names = [], []
        for entry in entries:
            path = Path(entry).expanduser()
            if path.is_dir():
                index = TaskManager(include_path=str(path.resolve()), include_defaults=False).task_index
                found = {n: e.cfg for n, e in index.items() if e.kind in (Kind.TASK, Kind.PY_TASK)}
                if not found:
                    raise ValueError(f"evaluate.lm_eval_tasks: the folder {entry} holds no lm-eval task YAML file")
                folders.append(str(path.resolve()))
                self.specs += sorted(found)
                self.configs.update(found)
            elif path.is_file():
                try:
                    found = TaskIndex.entry_from_path(path) if path.suffix in (".yaml", ".yml") else None
                except Exception:  # not YAML, not a mapping, no task or group key
                    found = None
                if found is None or found.kind not in (Kind.TASK, Kind.PY_TASK):
                    raise ValueError(
                        f"evaluate.lm_eval_tasks: {entry} is not an lm-eval task YAML file (a mapping with a task: "
                        "name); fix it, or name the task"
                    )
                self.specs.append(str(path.resolve()))
                self.configs[found.name] = load_yaml(path.resolve(), resolve_func=False)
            elif entry.endswith((".yaml", ".yml")) or "/" in entry:
                raise ValueError(
                    f"evaluate.lm_eval_tasks: {entry} is not a file or folder; give the path of a task YAML file or "
                    "of a folder of them, or a task name"
                )
            else:
                names.append(entry)
        self.manager = TaskManager(include_path=folders or None, include_defaults=bool(names))
        index = self.manager.task_index
        for name in names:
            if name not in index:
                near = difflib.get_close_matches(name, self.manager.all_tasks, n=3, cutoff=0.75)
                hint = f" (did you mean {' or '.join(near)}?)" if near else ""
                raise ValueError(
                    f"evaluate.lm_eval_tasks: {name!r} is not an lm-eval task{hint}; name one lm-eval knows "
                    "(lm-eval ls tasks), or the path of a task YAML file or folder"
                )
            entry = index[name]
            self.specs.append(name)
            self.configs[name] = entry.cfg if entry.kind in (Kind.TASK, Kind.PY_TASK) else None

    def figures(self) -> set[str] | None:
        """The ``<task>/<metric>`` keys the tasks produce, as their configs declare them (metric
        list, else lm-eval's defaults for the output type; filters); None when a group or tag
        stands for tasks not listed here."""
        from lm_eval.api.registry import DEFAULT_METRIC_REGISTRY

        if any(cfg is None for cfg in self.configs.values()):
            return None
        keys = set()
        for name, cfg in self.configs.items():
            metrics = [m["metric"] for m in cfg.get("metric_list") or [] if isinstance(m.get("metric"), str)]
            metrics = metrics or DEFAULT_METRIC_REGISTRY.get(cfg.get("output_type", "generate_until"), [])
            filters = [f.get("name", "none") for f in cfg.get("filter_list") or []] or ["none"]
            keys |= {f"{name}/{m}" if f == "none" else f"{name}/{m},{f}" for m in metrics for f in filters}
        return keys

    def check_figure(self, metric: str) -> None:
        """Refuse a gate figure no task produces."""
        keys = self.figures()
        if keys is None:  # a group or tag: its tasks and their figures are known once loaded
            return
        if metric not in keys:
            raise ValueError(
                f"evaluate.gate.metric={metric!r} is produced by no task of evaluate.lm_eval_tasks, whose figures "
                f"are {', '.join(sorted(keys))}; gate on one of those, or add the task that produces it"
            )


# -- measuring one model ----------------------------------------------------------------------


@dataclass(frozen=True)
class Measured:
    """One model's figures and generations."""

    figures: dict[str, float]
    higher_is_better: dict[str, bool]
    generations: list[dict]


def load_model(model_dir: str | Path, *, device: str, base_dir: str | None = None):
    """``(model, tokenizer)`` of ``model_dir`` in fp32 on ``device``, in eval mode: a model
    directory, or a peft adapter (its ``merged/`` model when there is one, else the adapter merged
    into ``base_dir``'s model with peft)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if device.split(":")[0] == "neuron":
        import torch_neuronx  # noqa: F401  (registers the neuron device with torch)

    path = Path(model_dir)
    adapter = (path / "adapter_config.json").is_file()
    if not (path / "config.json").is_file() and not adapter:
        raise ValueError(
            f"{path} is not a model directory (no config.json nor adapter_config.json); give the consolidated model"
        )
    if adapter and (path / "merged" / "config.json").is_file():
        model = AutoModelForCausalLM.from_pretrained(path / "merged", dtype=torch.float32)
    elif adapter:
        try:
            from peft import PeftModel
        except ImportError:
            raise ValueError(
                f"{path} is a LoRA adapter and evaluating it needs peft, which is not installed; install peft, or "
                "set hub.upload: both (the merged model is evaluated)"
            ) from None
        base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        model = PeftModel.from_pretrained(base, path).merge_and_unload()
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model.to(device).eval(), tokenizer


def generate(
    model, tokenizer, prompts: list[str | list[dict]], *, max_new_tokens: int, template: str | None, precision="fp32"
) -> list[dict]:
    """``{"prompt", "completion"}`` per prompt: greedy generation, one prompt at a time (no
    padding to change what a prompt sees), as the module docstring says."""
    import torch

    device = next(model.parameters()).device
    out = []
    with torch.no_grad(), precision_context(device, precision):
        for n, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                enc = tokenizer(prompt, return_tensors="pt")
            else:
                if template is None:
                    raise ValueError(
                        f"evaluate.prompts row {n + 1} is a conversation, but the tokenizer has no chat template; set "
                        "data.chat_template (e.g. neuron_parallel/chat_templates/chatml.jinja)"
                    )
                text = tokenizer.apply_chat_template(
                    prompt, chat_template=template, add_generation_prompt=True, tokenize=False
                )
                enc = tokenizer(text, add_special_tokens=False, return_tensors="pt")
            enc = enc.to(device)
            ids = model.generate(**enc, do_sample=False, max_new_tokens=max_new_tokens)
            new = ids[0, enc["input_ids"].shape[1] :]
            out.append({"prompt": prompt, "completion": tokenizer.decode(new, skip_special_tokens=True)})
    return out


def lm_eval_figures(
    model, tokenizer, tasks: LmEvalTasks, *, limit: int | None, precision: str = "fp32"
) -> tuple[dict[str, float], dict[str, bool]]:
    """``({"<task>/<metric>": value}, {key: higher is better})`` of ``lm_eval.simple_evaluate`` on
    ``model`` (an ``HFLM`` around it, on its device); stderr figures are left out (no bootstrap)."""
    import torch
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    device = next(model.parameters()).device
    autocast = {"mixed_precision_dtype": torch.bfloat16} if precision == "bf16" else {}
    lm = HFLM(pretrained=model, tokenizer=tokenizer, device=str(device), batch_size=LM_EVAL_BATCH, **autocast)
    out = simple_evaluate(
        lm, tasks=tasks.specs, task_manager=tasks.manager, limit=limit, bootstrap_iters=0, log_samples=False
    )
    figures, higher = {}, {}
    for task, metrics in out["results"].items():
        for key, value in metrics.items():
            name, sep, kind = key.partition(",")
            if not sep or name.endswith("_stderr") or isinstance(value, bool) or not isinstance(value, int | float):
                continue
            figure = f"{task}/{name if kind == 'none' else key}"
            figures[figure] = float(value)
            higher[figure] = bool(out.get("higher_is_better", {}).get(task, {}).get(name, True))
    return figures, higher


def reference_logps(model_dir: str, eval_path: str, *, device: str):
    """The summed log-probability of each completion of the preference eval rows at ``eval_path``
    under the model of ``model_dir`` (the dpo reference: the base model), in fp32 as the
    reference step computes them."""
    import gc

    from datasets import load_from_disk

    from .eval_loss import completion_logps

    model, _ = load_model(model_dir, device=device)
    try:
        return completion_logps(model, load_from_disk(eval_path).with_format("numpy"))[0]
    finally:
        del model
        gc.collect()


def measure(
    model_dir: str | Path,
    spec: EvaluateConfig,
    *,
    device: str,
    precision: str,
    eval_path: str | None,
    template: Callable[[Any], str | None],
    tasks: LmEvalTasks | None,
    objective: Objective = SFT,
    base_dir: str | None = None,
    log: Callable[[str], None] = print,
) -> Measured:
    """Load the model of ``model_dir`` and measure it (see the module docstring): the eval loss
    (by ``objective``) when ``eval_path`` is given, the generations of ``spec.prompts``, the
    lm-eval ``tasks``. ``template(tokenizer)`` is the chat template conversations are rendered
    with."""
    import gc

    model, tokenizer = load_model(model_dir, device=device, base_dir=base_dir)
    figures: dict[str, float] = {}
    higher: dict[str, bool] = {}
    generations: list[dict] = []
    try:
        if eval_path:
            figures[EVAL_LOSS], tokens = eval_loss(model, eval_path, precision=precision, objective=objective)
            higher[EVAL_LOSS] = False
            log(f"evaluate: {model_dir}: eval loss {figures[EVAL_LOSS]:.6f} over {tokens} tokens")
        if spec.prompts:
            generations = generate(
                model,
                tokenizer,
                read_prompts(spec.prompts),
                max_new_tokens=spec.max_new_tokens,
                template=template(tokenizer),
                precision=precision,
            )
            log(f"evaluate: {model_dir}: {len(generations)} generations")
        if tasks is not None:
            found, directions = lm_eval_figures(model, tokenizer, tasks, limit=spec.lm_eval_limit, precision=precision)
            figures.update(found)
            higher.update(directions)
            log(f"evaluate: {model_dir}: " + ", ".join(f"{k} {v:.4f}" for k, v in found.items()))
    finally:
        del model
        gc.collect()
    return Measured(figures, higher, generations)
