"""The train step as a Prefect task (``tasks.steps.train``): progress as an artifact and log lines."""

from prefect import get_run_logger, task
from prefect.artifacts import create_progress_artifact, update_progress_artifact

from neuron_parallel.data import TokenizedDataset
from neuron_parallel.launch import TrainResult
from neuron_parallel.planning.layout import CheckedLayout
from neuron_parallel.reporting import format_duration, format_event

from . import steps
from .common import STEP_POLICY
from .config import FinetuneConfig


@task(name="train", **STEP_POLICY)
def train(
    config: FinetuneConfig, dataset: TokenizedDataset, layout: CheckedLayout, reference_path: str | None = None
) -> TrainResult:
    """Safe to retry: training resumes from the newest complete checkpoint in output.dir."""
    log = get_run_logger()
    progress = create_progress_artifact(progress=0.0, key="train-progress", description="training steps done")

    def on_event(event: dict) -> None:
        if event["event"] == "step":
            done = f"step {event['step']}/{event['max_steps']}, eta {format_duration(event.get('eta_s', 0.0))}"
            update_progress_artifact(progress, progress=100.0 * event["step"] / event["max_steps"], description=done)
        log.info("%s", format_event(event))

    return steps.train(
        config, dataset, layout, on_event=on_event, log=log.info, on_line=log.debug, reference_path=reference_path
    )
