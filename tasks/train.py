"""Run distributed training as a torchrun subprocess tree."""

import os

from prefect import get_run_logger, task
from prefect.artifacts import create_progress_artifact, update_progress_artifact

from neuron_parallel.data import TokenizedDataset
from neuron_parallel.launch import LAUNCH_FILE_ENV, TrainResult, publish_launch, run_torchrun
from neuron_parallel.models import resolve_model_dir
from neuron_parallel.planning.layout import CheckedLayout
from neuron_parallel.reporting import format_duration

from .common import STEP_POLICY
from .config import FinetuneConfig


@task(name="train", **STEP_POLICY)
def train(config: FinetuneConfig, dataset: TokenizedDataset, layout: CheckedLayout) -> TrainResult:
    """Safe to retry: training resumes from the newest complete checkpoint in output.dir."""
    log = get_run_logger()
    model_dir = resolve_model_dir(config.model.name_or_path, config.model.revision)
    job = config.to_job(
        model_path=model_dir, dataset_path=dataset.path, eval_dataset_path=dataset.eval_path, layout=layout
    )
    progress = create_progress_artifact(progress=0.0, key="train-progress", description="training steps done")

    def on_event(event: dict) -> None:
        kind = event["event"]
        if kind == "step":
            eta = format_duration(event.get("eta_s", 0.0))
            done = f"step {event['step']}/{event['max_steps']}, eta {eta}"
            update_progress_artifact(progress, progress=100.0 * event["step"] / event["max_steps"], description=done)
            log.info(
                "step %d/%d loss %.4f lr %.2e %.0f tok/s eta %s",
                event["step"],
                event["max_steps"],
                event["loss"],
                event["lr"],
                event["tokens_per_s"],
                eta,
            )
        elif kind == "eval":
            log.info("step %d eval loss %.4f (%d tokens)", event["step"], event["eval_loss"], event["eval_tokens"])
        elif kind == "early_stop":
            log.info("early stop at step %d: %s", event["step"], event["reason"])
        elif kind == "resumed":
            log.info("resumed from step %d (%s)", event["step"], event["checkpoint"])
        elif kind == "memory":
            for r in event["ranks"]:
                log.info(
                    "rank %d peak tensor memory %.1f MiB, predicted %.1f MiB (%+.1f%%)",
                    r["rank"],
                    r["measured_bytes"] / 2**20,
                    r["predicted_bytes"] / 2**20,
                    100 * (r["predicted_bytes"] / r["measured_bytes"] - 1),
                )
        elif kind in ("checkpoint", "warning", "start"):
            log.info("%s: %s", kind, {k: v for k, v in event.items() if k != "event"})

    launch = config.to_launch()
    if launch.nnodes > 1 and os.environ.get(LAUNCH_FILE_ENV):
        publish_launch(os.environ[LAUNCH_FILE_ENV], job, launch)  # the other nodes' `neuron-flows join`
        log.info("published the launch for %d more nodes at %s", launch.nnodes - 1, os.environ[LAUNCH_FILE_ENV])
    return run_torchrun(job, launch, on_event=on_event, on_line=log.debug)
