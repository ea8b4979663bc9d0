"""Check the parallel layout against the model and the world size."""

from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact

from neuron_parallel.data import TokenizedDataset
from neuron_parallel.models.causal_lm import resolve_model_dir
from neuron_parallel.plan import Plan, check_plan

from .common import STEP_POLICY
from .config import FinetuneConfig


@task(name="plan", **STEP_POLICY)
def plan(config: FinetuneConfig, dataset: TokenizedDataset) -> Plan:
    model_dir = resolve_model_dir(config.model.name_or_path, config.model.revision)
    result = check_plan(config.to_job(model_path=model_dir, dataset_path=dataset.path))
    pc = result.parallel
    row = {
        "dp": pc.dp, "tp": pc.tp, "pp": pc.pp, "zero_1": pc.zero_1, "sequence_parallel": pc.sequence_parallel,
        "num_microbatches": pc.num_microbatches, "global_batch_size": result.global_batch_size,
        "parameters": result.num_parameters, "layers_per_stage": str(result.layers_per_stage),
    }
    create_table_artifact(key="plan", table=[row], description="Parallel layout chosen for this run")
    get_run_logger().info("plan: %s %s", row, "; ".join(result.notes))
    return result
