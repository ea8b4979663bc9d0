"""Validate the newest checkpoint of the run."""

from prefect import get_run_logger, task

from neuron_parallel.checkpoint import resolve_checkpoint, validate_checkpoint
from neuron_parallel.launch import TrainResult

from .common import STEP_POLICY


@task(name="validate", **STEP_POLICY)
def validate(result: TrainResult) -> str:
    ckpt = resolve_checkpoint(result.run_dir)
    problems = validate_checkpoint(ckpt)
    if problems:
        raise ValueError(f"checkpoint {ckpt} is invalid:\n" + "\n".join(problems))
    get_run_logger().info("checkpoint %s is valid", ckpt)
    return str(ckpt)
