"""The report step as a Prefect task (``tasks.steps.report``): the summary as a markdown artifact."""

from prefect import task
from prefect.artifacts import create_markdown_artifact

from neuron_parallel.hub import HubCommit
from neuron_parallel.launch import TrainResult
from neuron_parallel.planning.layout import CheckedLayout

from . import steps
from .common import STEP_POLICY


@task(name="report", **STEP_POLICY)
def report(
    result: TrainResult, layout: CheckedLayout, checkpoint: str, model_dir: str, commit: HubCommit | None
) -> str:
    """The run's summary (``steps.report``), published as the ``summary`` artifact; returns its markdown."""
    markdown = steps.report(result, layout, checkpoint, model_dir, commit)
    create_markdown_artifact(key="summary", markdown=markdown, description="Loss curve, checkpoints, model, Hub commit")
    return markdown
