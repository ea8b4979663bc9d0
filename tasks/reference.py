"""The reference step as a Prefect task (``tasks.steps.reference``): DPO's reference
log-probabilities, between tokenize and train."""

from prefect import get_run_logger, task

from neuron_parallel.data import TokenizedDataset

from . import steps
from .common import STEP_POLICY
from .config import FinetuneConfig


@task(name="reference", **STEP_POLICY)
def reference(config: FinetuneConfig, dataset: TokenizedDataset) -> str | None:
    """Cached beside the rows by data fingerprint and reference weights' digest: safe to retry."""
    return steps.reference(config, dataset, log=get_run_logger().info)
