"""The tokenize step as a Prefect task (``tasks.steps.tokenize``), publishing the data audit."""

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from neuron_parallel.audit import audit_markdown, audit_table
from neuron_parallel.data import TokenizedDataset

from . import steps
from .common import STEP_POLICY
from .config import FinetuneConfig


@task(name="tokenize", **STEP_POLICY)
def tokenize(config: FinetuneConfig) -> TokenizedDataset:
    ds = steps.tokenize(config, log=get_run_logger().info)
    create_table_artifact(key="data-audit", table=audit_table(ds.audit), description="What the tokenize step made")
    create_markdown_artifact(key="data-sample", markdown=audit_markdown(ds.audit), description="First example")
    return ds
