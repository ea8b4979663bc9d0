"""The preflight step as a Prefect task (``tasks.steps.preflight``): never retried, since what it
refuses fails the same way every time. It returns the config with every Hub name's revision
resolved to a commit, which the flow's later steps take."""

from prefect import get_run_logger, task

from . import steps
from .common import hub_token, remember_failed_step
from .config import FinetuneConfig


@task(name="preflight", retries=0, on_failure=[remember_failed_step])
def preflight(config: FinetuneConfig) -> FinetuneConfig:
    return steps.preflight(config, hub_token=hub_token(config), check_upload=True, warn=get_run_logger().warning)
