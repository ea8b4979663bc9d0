"""Consolidate the validated checkpoint into a Hugging Face model directory."""

from prefect import get_run_logger, task

from neuron_parallel.checkpoint import consolidate_checkpoint

from .common import STEP_POLICY
from .config import FinetuneConfig


@task(name="consolidate", **STEP_POLICY)
def consolidate(config: FinetuneConfig, checkpoint: str) -> str:
    out = consolidate_checkpoint(
        checkpoint, config.consolidated_path, fmt=config.output.format, max_shard_size=config.output.max_shard_size
    )
    get_run_logger().info("consolidated %s -> %s", checkpoint, out)
    return str(out)
