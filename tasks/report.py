"""The report step as a Prefect task (``tasks.steps.report``): the summary as a markdown artifact,
saying what changed in the model's and the data's revisions since the previous run of the same
fine-tune (the ``lineage-<digest>`` artifact each run leaves)."""

from __future__ import annotations

import json

from prefect import task
from prefect.artifacts import Artifact, create_markdown_artifact, create_table_artifact

from neuron_parallel.hub import HubCommit
from neuron_parallel.launch import TrainResult
from neuron_parallel.lineage import from_identity_rows, identity_rows, source_changes, sources_key
from neuron_parallel.planning.layout import CheckedLayout

from . import steps
from .common import STEP_POLICY


@task(name="report", **STEP_POLICY)
def report(
    result: TrainResult, layout: CheckedLayout, checkpoint: str, model_dir: str, commit: HubCommit | None
) -> str:
    """The run's summary (``steps.report``), published as the ``summary`` artifact, with a line on
    the sources since the previous run (:func:`since_previous_run`); returns its markdown."""
    since = since_previous_run(steps.run_lineage(result.run_dir))
    markdown = steps.report(result, layout, checkpoint, model_dir, commit, since_previous=since)
    create_markdown_artifact(key="summary", markdown=markdown, description="Loss curve, checkpoints, model, Hub commit")
    return markdown


def since_previous_run(lineage: dict) -> str | None:
    """What changed in the model's and every data source's revision since the previous run of the
    same fine-tune (the same model and sources by name: ``lineage.sources_key``), in words, and
    this run's identities left as the ``lineage-<key>`` table artifact for the next one. The
    previous run is the newest to have left that artifact, a scheduled run's last occurrence
    included. None when the run records no lineage."""
    if not lineage:
        return None
    key = f"lineage-{sources_key(lineage)}"
    previous = Artifact.get(key)
    create_table_artifact(
        table=identity_rows(lineage), key=key, description="The model's and the data's identities (repo at commit)"
    )
    if previous is None:
        return "first run of this model on these sources"
    rows = json.loads(previous.data) if isinstance(previous.data, str) else previous.data
    changes = source_changes(from_identity_rows(rows), lineage)
    since = f"since flow run {_run_name(previous.flow_run_id)}"
    return f"changed {since}: " + "; ".join(changes) if changes else f"unchanged {since}"


def _run_name(flow_run_id) -> str:
    """A flow run's name (its id where the run is gone or was none)."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    if flow_run_id is None:
        return "(outside a flow)"
    try:
        with get_client(sync_client=True) as client:
            return f"`{client.read_flow_run(flow_run_id).name}`"
    except ObjectNotFound:  # a deleted run: its id still says which
        return f"`{flow_run_id}`"
