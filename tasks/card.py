"""The model card of a run's consolidated model: its training summary, its config with the
planner's choices filled in, and the card written beside the weights with the loss curve. The card
is published with the model, so it names local models, data and files by their last component
only (``neuron_parallel.hub.published_config``)."""

import json
from pathlib import Path

from neuron_parallel.config import PLANNED_FIELDS, JobConfig, TrainConfig, resolve_precision
from neuron_parallel.data import AUDIT_FILE
from neuron_parallel.hub import base_model_license, card_data_table, published_name, write_model_card
from neuron_parallel.launch import TrainResult
from neuron_parallel.planning.layout import CheckedLayout, describe_layout
from neuron_parallel.promotion import Evaluation
from neuron_parallel.reporting import loss_curve_png, read_metrics
from neuron_parallel.run_files import JOB_FILE, LOSS_CURVE_FILE, METRICS_FILE

from .config import FinetuneConfig


def card_summary(config: FinetuneConfig, result: TrainResult, layout: CheckedLayout) -> dict[str, object]:
    """The model card's training summary: steps, losses, tokens, layout and hardware; under a
    preference objective also the objective and its reward figures (:func:`preference_summary`)."""
    metrics, pc = result.last_metrics, layout.parallel
    summary = {
        "steps": result.final_step,
        "final loss": round(metrics.get("loss", float("nan")), 4),
        **({"eval loss": round(metrics["eval_loss"], 4)} if "eval_loss" in metrics else {}),
        "layout": describe_layout(pc),
        "batch": f"{layout.global_batch_size} sequences of {config.data.block_size} tokens per step "
        f"(micro batch {layout.micro_batch_size} × accumulation {layout.grad_accum} × dp {pc.dp})",
        "hardware": f"{published_name(config.hardware)}: {config.launch.nnodes} node(s) × "
        f"{config.launch.nproc_per_node} {config.launch.device} rank(s), "
        f"{resolve_precision(pc.mixed_precision, config.launch.device)}",
        "tokens seen": metrics.get("tokens_seen"),
    }
    lora = config.train.lora
    if lora is not None:
        summary["LoRA"] = f"r={lora.r} alpha={lora.alpha:g} on {', '.join(lora.target_modules)} ({config.hub.upload})"
    train = config.library("train", micro_batch_size=1)  # the micro batch plays no part here
    if train.objective != "sft":
        summary.update(preference_summary(train, metrics))
    return summary


PREFERENCE_FIGURES = ("rewards_accuracy", "rewards_margin", "rewards_chosen", "rewards_rejected")
"""The reward figures of a preference run the card shows, at the last step and on the eval pairs
(``neuron_parallel.preference.stats_row``'s names)."""


def preference_summary(train: TrainConfig, metrics: dict) -> dict[str, object]:
    """The card's rows of a preference run (``train``: the run's training settings): its objective
    with the settings it takes, and the last step's reward figures (``final …``) and the eval
    pairs' (``eval …``), where measured. The loss rows above it are then the objective's loss, a
    mean over pairs."""
    pref, objective = train.preference, train.objective
    settings = {
        "dpo": f"{pref.loss_type}, beta={pref.beta:g}, label_smoothing={pref.label_smoothing:g}",
        "simpo": f"beta={pref.beta:g}, gamma={pref.gamma:g}, label_smoothing={pref.label_smoothing:g}",
        "orpo": f"beta (the odds-ratio weight λ)={pref.beta:g}",
    }[objective]
    rows: dict[str, object] = {"objective": f"{objective} ({settings})"}
    for prefix, label in (("", "final"), ("eval_", "eval")):
        for name in PREFERENCE_FIGURES:
            if prefix + name in metrics:
                rows[f"{label} {name}"] = round(metrics[prefix + name], 4)
    return rows


def card_config(config: FinetuneConfig, layout: CheckedLayout) -> dict:
    """The run's configuration as the card shows it: the fields left ``auto`` hold what the
    planner chose, and ``parallel.mixed_precision`` the precision the run had, so that the block
    runs the same layout and precision anywhere. ``train.resume_from`` is left out: a run started
    from the card's config starts afresh (and the checkpoint is this machine's). The card writer
    names the remaining local paths by their last component."""
    dumped = config.model_dump(mode="json")
    chosen = {"parallel": layout.parallel, "train": layout}
    for section, names in PLANNED_FIELDS.items():
        for name in names:
            if dumped[section][name] == "auto":
                dumped[section][name] = getattr(chosen[section], name)
    dumped["parallel"]["mixed_precision"] = resolve_precision(layout.parallel.mixed_precision, config.launch.device)
    dumped["train"]["resume_from"] = None
    return dumped


def write_card(
    config: FinetuneConfig,
    model_dir: str,
    result: TrainResult,
    layout: CheckedLayout,
    evaluation: Evaluation | None = None,
) -> None:
    """The model card, with the loss curve beside it, the data as the tokenize step audited it
    and, given the evaluate step's ``evaluation``, its figures (the card's eval results) and
    generations."""
    job = JobConfig.load(Path(result.run_dir) / JOB_FILE)
    audit_path = Path(job.dataset_path).parent / AUDIT_FILE  # beside the rows (see TokenizedDataset.path)
    audit = json.loads(audit_path.read_text()) if audit_path.is_file() else {}
    sources = [config.data.source] if isinstance(config.data.source, str) else list(config.data.source)
    (Path(model_dir) / LOSS_CURVE_FILE).write_bytes(loss_curve_png(read_metrics(Path(result.run_dir) / METRICS_FILE)))
    write_model_card(
        model_dir,
        repo_id=config.hub.repo_id,
        base_model=config.model.name_or_path,
        datasets=sources,
        summary=card_summary(config, result, layout),
        data=card_data_table(audit, sources=sources, block_size=job.block_size) if audit else None,
        config=card_config(config, layout),
        loss_curve=LOSS_CURVE_FILE,
        license=base_model_license(job.model_path),
        lineage=job.lineage,  # the base model's and the data's identities, as the checkpoints record them
        evaluation=evaluation,
    )
