"""Write the model card and upload the consolidated model to the Hub, when a repo is set."""

import os

from prefect import get_run_logger, task

from neuron_parallel.hub import HubCommit, upload_model, write_model_card
from neuron_parallel.launch import TrainResult
from neuron_parallel.planning.layout import CheckedLayout

from .common import STEP_POLICY
from .config import FinetuneConfig


def hub_token(config: FinetuneConfig) -> str | None:
    """The Hub token from the Prefect Secret block named in the config, else HF_TOKEN. Never a
    flow parameter, never logged."""
    if config.hub.token_secret:
        from prefect.blocks.system import Secret

        return Secret.load(config.hub.token_secret).get()
    return os.environ.get("HF_TOKEN")


@task(name="upload", **STEP_POLICY)
def upload(config: FinetuneConfig, model_dir: str, result: TrainResult, layout: CheckedLayout) -> HubCommit | None:
    log = get_run_logger()
    metrics = result.last_metrics
    summary = {
        "steps": result.final_step,
        "final loss": round(metrics.get("loss", float("nan")), 4),
        **({"eval loss": round(metrics["eval_loss"], 4)} if "eval_loss" in metrics else {}),
        "layout": f"dp={layout.parallel.dp} tp={layout.parallel.tp} pp={layout.parallel.pp}"
        + " zero1" * layout.parallel.zero_1,
        "tokens seen": metrics.get("tokens_seen"),
    }
    lora = config.train.lora
    if lora is not None:
        summary["LoRA"] = f"r={lora.r} alpha={lora.alpha:g} on {', '.join(lora.target_modules)} ({config.hub.upload})"
    sources = [config.data.source] if isinstance(config.data.source, str) else list(config.data.source)
    write_model_card(
        model_dir, repo_id=config.hub.repo_id, base_model=config.model.name_or_path, datasets=sources, summary=summary
    )
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
    )
    log.info("uploaded to %s (revision %s)", commit.url, commit.revision)
    return commit
