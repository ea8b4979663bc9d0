"""The validate step as a Prefect task (``tasks.steps.validate``)."""

from prefect import get_run_logger, task

from neuron_parallel.launch import TrainResult

from . import steps
from .common import STEP_POLICY


@task(name="validate", **STEP_POLICY)
def validate(result: TrainResult) -> str:
    return steps.validate(result.run_dir, log=get_run_logger().info)
