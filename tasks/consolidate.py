"""The consolidate step as a Prefect task (``tasks.steps.consolidate``), in the flow's transaction
with the upload: the model is written beside ``output.consolidated_dir`` and put in place by the
upload once published; if the upload fails, the rollback drops it, and an earlier run's model
there stays as it was."""

from prefect import get_run_logger, task
from prefect.transactions import get_transaction

from neuron_parallel.checkpoint.output import discard_staged

from . import steps
from .common import STEP_POLICY
from .config import FinetuneConfig


@task(name="consolidate", **STEP_POLICY)
def consolidate(config: FinetuneConfig, checkpoint: str) -> str:
    out = steps.consolidate(config, checkpoint, log=get_run_logger().info)
    txn = get_transaction()
    if txn is not None:
        txn.set("model_dir", out)
    return out


@consolidate.on_rollback
def _discard_staged(txn) -> None:
    """A later step of the transaction (the upload) failed: drop the staged model (a folder
    neuron-flows created, nothing else), so that what is on disk never claims to be a published
    model and a retry consolidates afresh; the model already at ``output.consolidated_dir`` (an
    earlier run's) is never touched, and put back if the swap was cut short."""
    path = txn.get("model_dir", None)
    if path:
        discard_staged(path)
