"""The consolidate step as a Prefect task (``tasks.steps.consolidate``), in the flow's transaction
with the upload: its rollback removes what it wrote when the upload fails."""

import shutil

from prefect import get_run_logger, task
from prefect.transactions import get_transaction

from neuron_parallel.checkpoint.output import is_ours

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
def _remove_consolidated(txn) -> None:
    """A later step of the transaction (the upload) failed: remove the directory, so that what
    is on disk never claims to be a published model and a retry consolidates afresh."""
    path = txn.get("model_dir", None)
    if path and is_ours(path):  # only a directory neuron-flows wrote (never a folder of the user's)
        shutil.rmtree(path)
