"""Consolidate the validated checkpoint into a Hugging Face model directory (LoRA runs: the peft
adapter, the merged model or both, as ``hub.upload`` says)."""

import shutil

from prefect import get_run_logger, task
from prefect.transactions import get_transaction

from neuron_parallel.checkpoint import consolidate_checkpoint
from neuron_parallel.checkpoint.adapter import export_lora
from neuron_parallel.checkpoint.output import is_ours

from .common import STEP_POLICY
from .config import FinetuneConfig


@task(name="consolidate", **STEP_POLICY)
def consolidate(config: FinetuneConfig, checkpoint: str) -> str:
    formats = {"fmt": config.output.format, "max_shard_size": config.output.max_shard_size}
    if config.train.lora is None:
        out = consolidate_checkpoint(checkpoint, config.consolidated_path, **formats)
    else:
        out = export_lora(
            checkpoint,
            config.consolidated_path,
            kind=config.hub.upload,
            base_model_name=config.model.name_or_path,
            base_model_revision=config.model.revision,
            **formats,
        )
    txn = get_transaction()
    if txn is not None:
        txn.set("model_dir", str(out))
    get_run_logger().info("consolidated %s -> %s", checkpoint, out)
    return str(out)


@consolidate.on_rollback
def _remove_consolidated(txn) -> None:
    """A later step of the transaction (the upload) failed: remove the directory, so that what
    is on disk never claims to be a published model and a retry consolidates afresh."""
    path = txn.get("model_dir", None)
    if path and is_ours(path):  # only a directory neuron-flows wrote (never a folder of the user's)
        shutil.rmtree(path)
