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


# The flow runs consolidate and upload in one transaction, and Prefect (3.9) rolls the whole
# transaction back when any attempt of a task in it fails, retried or not: a Prefect retry of the
# upload would find the consolidated model removed. So the task makes one attempt, and the upload
# retries transient Hub failures inside it.
UPLOAD_POLICY = {**STEP_POLICY, "retries": 0}
UPLOAD_RETRIES = 2
UPLOAD_RETRY_DELAY_S = 5.0


@task(name="upload", **UPLOAD_POLICY)
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
