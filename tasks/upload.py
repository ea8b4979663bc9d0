"""The upload step as a Prefect task (``tasks.steps.upload``): the model card, then the Hub."""

from prefect import get_run_logger, task

from neuron_parallel.hub import HubCommit
from neuron_parallel.launch import TrainResult
from neuron_parallel.planning.layout import CheckedLayout
from neuron_parallel.promotion import Evaluation

from . import steps
from .common import STEP_POLICY, hub_token
from .config import FinetuneConfig

# The flow runs consolidate and upload in one transaction, and Prefect (3.9) rolls the whole
# transaction back when any attempt of a task in it fails, retried or not: a Prefect retry of the
# upload would find the consolidated model removed. So the task makes one attempt, and the upload
# retries transient Hub failures inside it (``steps.upload``).
UPLOAD_POLICY = {**STEP_POLICY, "retries": 0}


@task(name="upload", **UPLOAD_POLICY)
def upload(
    config: FinetuneConfig,
    model_dir: str,
    result: TrainResult,
    layout: CheckedLayout,
    evaluation: Evaluation | None = None,
) -> HubCommit | None:
    log = get_run_logger()
    token = hub_token(config)
    return steps.upload(
        config, model_dir, result, layout, token=token, evaluation=evaluation, log=log.info, warn=log.warning
    )
