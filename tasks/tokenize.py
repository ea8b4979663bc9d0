"""Tokenize and pack the dataset."""

from prefect import get_run_logger, task

from neuron_parallel.data import TokenizedDataset, tokenize_data
from neuron_parallel.models.causal_lm import resolve_model_dir

from .common import STEP_POLICY
from .config import FinetuneConfig


@task(name="tokenize", **STEP_POLICY)
def tokenize(config: FinetuneConfig) -> TokenizedDataset:
    model_dir = resolve_model_dir(config.model.name_or_path, config.model.revision)
    ds = tokenize_data(config.library("data"), model_dir)
    get_run_logger().info(
        "tokenized %s: %d tokens, %d blocks of %d, fingerprint %s",
        config.data.source,
        ds.num_tokens,
        ds.num_blocks,
        ds.block_size,
        ds.fingerprint,
    )
    return ds
