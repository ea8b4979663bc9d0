"""Tokenize, mask and pack the dataset, and publish its audit."""

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from neuron_parallel.audit import audit_markdown, audit_summary, audit_table
from neuron_parallel.data import TokenizedDataset, tokenize_data
from neuron_parallel.models import resolve_model_dir

from .common import STEP_POLICY
from .config import FinetuneConfig


@task(name="tokenize", **STEP_POLICY)
def tokenize(config: FinetuneConfig) -> TokenizedDataset:
    model_dir = resolve_model_dir(config.model.name_or_path, config.model.revision)
    ds = tokenize_data(config.library("data"), model_dir)
    get_run_logger().info(
        "tokenized %s: %d rows of %d (%s attention), fingerprint %s; %s",
        config.data.source,
        ds.num_blocks,
        ds.block_size,
        ds.attention,
        ds.fingerprint,
        audit_summary(ds.audit),
    )
    create_table_artifact(key="data-audit", table=audit_table(ds.audit), description="What the tokenize step made")
    create_markdown_artifact(key="data-sample", markdown=audit_markdown(ds.audit), description="First example")
    return ds
