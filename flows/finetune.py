"""The fine-tuning pipeline: preflight → tokenize → plan → train → validate → consolidate → upload →
report."""

from __future__ import annotations

from prefect import flow
from prefect.runtime import flow_run
from prefect.transactions import transaction

from neuron_flows.flows.notify import failed_state
from neuron_flows.tasks.config import FinetuneConfig
from neuron_flows.tasks.consolidate import consolidate
from neuron_flows.tasks.plan import plan
from neuron_flows.tasks.preflight import preflight
from neuron_flows.tasks.report import report
from neuron_flows.tasks.tokenize import tokenize
from neuron_flows.tasks.train import train
from neuron_flows.tasks.upload import upload
from neuron_flows.tasks.validate import validate


@flow(name="finetune", log_prints=True)
def finetune(config: FinetuneConfig = FinetuneConfig()) -> dict:  # noqa: B008 (the UI form shows this default)
    """Fine-tune ``config.model`` on ``config.data`` and publish the consolidated model.

    Retrying a failed run reruns no finished step (results persist under a key of inputs, task
    code and flow run) and training continues from the newest complete checkpoint. Consolidation
    and upload form one transaction: if the upload fails, the consolidated directory is removed
    again, so a retry never publishes a stale or half-written model."""
    config = config.for_run(flow_run.get_name() or "local", flow_run.get_id() or "local")
    try:
        return _pipeline(config)
    except Exception as exc:  # the run ends Failed with its step, progress and checkpoint in its message
        return failed_state(config.output.dir, exc)


def _pipeline(config: FinetuneConfig) -> dict:
    """The steps of :func:`finetune`, for the run's config (output paths filled in)."""
    preflight(config)
    dataset = tokenize(config)
    layout = plan(config, dataset)
    result = train.with_options(retries=config.launch.retries)(config, dataset, layout)
    checkpoint = validate(result)
    with transaction():
        model_dir = consolidate(config, checkpoint)
        commit = upload(config, model_dir, result, layout)
    report(result, layout, checkpoint, model_dir, commit)
    return {
        "run_dir": result.run_dir,
        "checkpoint": checkpoint,
        "consolidated": model_dir,
        "final_step": result.final_step,
        "hub_url": commit.url if commit else None,
    }
