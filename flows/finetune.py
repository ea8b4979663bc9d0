"""The fine-tuning pipeline: preflight → tokenize → reference (DPO fully fine-tuned) → plan → train →
validate → consolidate → evaluate → upload (when the evaluation promotes the model) → report."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prefect import flow
from prefect.runtime import flow_run
from prefect.transactions import transaction

from neuron_flows.flows.notify import failed_state, not_promoted_state
from neuron_flows.tasks import steps
from neuron_flows.tasks.config import FinetuneConfig
from neuron_flows.tasks.consolidate import consolidate
from neuron_flows.tasks.evaluate import evaluate
from neuron_flows.tasks.plan import plan
from neuron_flows.tasks.preflight import preflight
from neuron_flows.tasks.reference import reference
from neuron_flows.tasks.report import report
from neuron_flows.tasks.tokenize import tokenize
from neuron_flows.tasks.train import train
from neuron_flows.tasks.upload import upload
from neuron_flows.tasks.validate import validate

if TYPE_CHECKING:
    from prefect.states import State


@flow(name="finetune", log_prints=True)
def finetune(config: FinetuneConfig = FinetuneConfig()) -> dict:  # noqa: B008 (the UI form shows this default)
    """Fine-tune ``config.model`` on ``config.data`` and publish the consolidated model.

    Retrying a failed run reruns no finished step (results persist under a key of inputs, task
    code and flow run) and training continues from the newest complete checkpoint. Consolidation
    and upload form one transaction: the model is written beside ``output.consolidated_dir`` and put
    in place once uploaded; if the upload fails it is dropped (an earlier run's model there stays),
    so a retry never publishes a stale or half-written model. Between the two, the evaluate step
    measures the model and decides ``evaluate.gate``: a model that does not meet it is not
    uploaded and stays staged beside ``output.consolidated_dir``, and the run ends Completed in the
    state ``NotPromoted`` with the reason as its message (``flows.notify.not_promoted_state``)."""
    config = config.for_run(flow_run.get_name() or "local", flow_run.get_id() or "local")
    try:
        return _pipeline(config)
    except Exception as exc:  # the run ends Failed with its step, progress and checkpoint in its message
        return failed_state(config.output.dir, exc)


def _pipeline(config: FinetuneConfig) -> dict | State:
    """The steps of :func:`finetune`, for the run's config (output paths filled in)."""
    config = preflight(config)  # every Hub name at the commit it resolved to
    dataset = tokenize(config)
    reference_path = reference(config, dataset) if steps.needs_reference(config) else None  # DPO, full weights
    layout = plan(config, dataset)
    result = train.with_options(retries=config.launch.retries)(config, dataset, layout, reference_path)
    checkpoint = validate(result)
    with transaction():
        model_dir = consolidate(config, checkpoint)
        evaluation = evaluate(config, model_dir, dataset)
        commit = upload(config, model_dir, result, layout, evaluation) if evaluation.promoted else None
    model = model_dir if evaluation.promoted else evaluation.model_dir  # a model not promoted stays staged
    report(result, layout, checkpoint, model, commit)
    summary = {
        "run_dir": result.run_dir,
        "checkpoint": checkpoint,
        "consolidated": model,
        "final_step": result.final_step,
        "hub_url": commit.url if commit else None,
        "promoted": evaluation.promoted,
        "reason": evaluation.reason,
    }
    return summary if evaluation.promoted else not_promoted_state(summary, evaluation.reason)
