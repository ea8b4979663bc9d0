"""Write the model card and upload the consolidated model to the Hub, when a repo is set."""

import json
import os
from pathlib import Path

from prefect import get_run_logger, task

from neuron_parallel.config import PLANNED_FIELDS, JobConfig
from neuron_parallel.data import AUDIT_FILE
from neuron_parallel.hub import HubCommit, base_model_license, card_data_table, upload_model, write_model_card
from neuron_parallel.launch import TrainResult
from neuron_parallel.planning.layout import CheckedLayout
from neuron_parallel.reporting import read_metrics

from .common import STEP_POLICY
from .config import FinetuneConfig
from .report import loss_curve_png

LOSS_CURVE = "loss_curve.png"
"""The loss curve's file next to the model card (README.md), which embeds it."""


def hub_token(config: FinetuneConfig) -> str | None:
    """The Hub token from the Prefect Secret block named in the config, else HF_TOKEN. Never a
    flow parameter, never logged."""
    if config.hub.token_secret:
        from prefect.blocks.system import Secret

        return Secret.load(config.hub.token_secret).get()
    return os.environ.get("HF_TOKEN")


# The flow runs consolidate and upload in one transaction, and Prefect (3.9) rolls the whole
# transaction back when any attempt of a task in it fails, retried or not: a Prefect retry of the
# upload would find the consolidated model removed. So the task makes one attempt, and the upload
# retries transient Hub failures inside it.
UPLOAD_POLICY = {**STEP_POLICY, "retries": 0}
UPLOAD_RETRIES = 2
UPLOAD_RETRY_DELAY_S = 5.0


def card_summary(config: FinetuneConfig, result: TrainResult, layout: CheckedLayout) -> dict[str, object]:
    """The model card's training summary: steps, losses, tokens, layout and hardware."""
    metrics, pc = result.last_metrics, layout.parallel
    summary = {
        "steps": result.final_step,
        "final loss": round(metrics.get("loss", float("nan")), 4),
        **({"eval loss": round(metrics["eval_loss"], 4)} if "eval_loss" in metrics else {}),
        "layout": f"dp={pc.dp} tp={pc.tp} pp={pc.pp}" + " zero1" * pc.zero_1 + " sp" * pc.sequence_parallel,
        "batch": f"{layout.global_batch_size} sequences of {config.data.block_size} tokens per step "
        f"(micro batch {layout.micro_batch_size} × accumulation {layout.grad_accum} × dp {pc.dp})",
        "hardware": f"{config.hardware}: {config.launch.nnodes} node(s) × {config.launch.nproc_per_node} "
        f"{config.launch.device} rank(s), {pc.mixed_precision}",
        "tokens seen": metrics.get("tokens_seen"),
    }
    lora = config.train.lora
    if lora is not None:
        summary["LoRA"] = f"r={lora.r} alpha={lora.alpha:g} on {', '.join(lora.target_modules)} ({config.hub.upload})"
    return summary


def card_config(config: FinetuneConfig, layout: CheckedLayout) -> dict:
    """The run's configuration as the card shows it: the fields left ``auto`` hold what the
    planner chose, so that the block runs the same layout anywhere."""
    dumped = config.model_dump(mode="json")
    chosen = {"parallel": layout.parallel, "train": layout}
    for section, names in PLANNED_FIELDS.items():
        for name in names:
            if dumped[section][name] == "auto":
                dumped[section][name] = getattr(chosen[section], name)
    return dumped


def write_card(config: FinetuneConfig, model_dir: str, result: TrainResult, layout: CheckedLayout) -> None:
    """The model card, with the loss curve beside it and the data as the tokenize step audited it."""
    job = JobConfig.load(Path(result.run_dir) / "job.json")
    audit_path = Path(job.dataset_path).parent / AUDIT_FILE  # beside the rows (see TokenizedDataset.path)
    audit = json.loads(audit_path.read_text()) if audit_path.is_file() else {}
    sources = [config.data.source] if isinstance(config.data.source, str) else list(config.data.source)
    (Path(model_dir) / LOSS_CURVE).write_bytes(loss_curve_png(read_metrics(Path(result.run_dir) / "metrics.jsonl")))
    write_model_card(
        model_dir,
        repo_id=config.hub.repo_id,
        base_model=config.model.name_or_path,
        datasets=sources,
        summary=card_summary(config, result, layout),
        data=card_data_table(audit, sources=sources, block_size=job.block_size) if audit else None,
        config=card_config(config, layout),
        loss_curve=LOSS_CURVE,
        license=base_model_license(job.model_path),
    )


@task(name="upload", **UPLOAD_POLICY)
def upload(config: FinetuneConfig, model_dir: str, result: TrainResult, layout: CheckedLayout) -> HubCommit | None:
    log = get_run_logger()
    write_card(config, model_dir, result, layout)
    if not config.hub.repo_id:
        log.info("no hub.repo_id configured: the model stays at %s and nothing is uploaded", model_dir)
        return None
    commit = upload_model(
        model_dir,
        repo_id=config.hub.repo_id,
        endpoint=config.hub.endpoint,
        token=hub_token(config),
        private=config.hub.private,
        commit_message=f"neuron-flows: {result.final_step} steps",
        retries=UPLOAD_RETRIES,
        retry_delay_s=UPLOAD_RETRY_DELAY_S,
        on_retry=lambda attempt, err: log.warning(
            "upload attempt %d failed (%s: %s); trying again in %.0f s",
            attempt,
            type(err).__name__,
            err,
            UPLOAD_RETRY_DELAY_S,
        ),
    )
    log.info("uploaded to %s (revision %s)", commit.url, commit.revision)
    return commit
