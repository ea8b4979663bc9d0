"""Failure notifications for the fine-tuning deployments, in two halves.

* In the flow run, :func:`failed_state`: when a step fails, the run ends Failed with a state
  message that says what a person needs to act on: the step (task) that failed, the last training
  step and its loss, the newest complete checkpoint, and the error. The UI shows it on the run's
  page; the notification below quotes it. Prefect's flow-run events carry the state message, never
  the run directory, so the flow run is the one place that can write these facts.
* In the flow run, :func:`not_promoted_state`: when the evaluate step's gate keeps the model from
  being published, the run ends Completed in the state named ``NotPromoted``, the reason as its
  message.
* On the server, :func:`sync_failure_notifications`: a Prefect automation whose trigger is the
  ``prefect.flow-run.Failed``, ``prefect.flow-run.Crashed`` or ``prefect.flow-run.NotPromoted``
  event of a run of a deployment of the fine-tuning flow, and whose action posts a message (run
  name, state message, run page, how to retry) through a ``CustomWebhookNotificationBlock`` to the
  webhook at ``NEURON_FLOWS_NOTIFY_WEBHOOK``. The server renders the message with its own
  templates (``flow_run``, ``flow``, ``deployment``).

A Crashed run's process ended without reporting (killed, its node lost): its message is the
reason Prefect or ``neuron-flows serve`` recorded, and its last step and checkpoint are in its logs
and run directory.
"""

from __future__ import annotations

import os
from pathlib import Path

WEBHOOK_ENV = "NEURON_FLOWS_NOTIFY_WEBHOOK"
"""The webhook URL failure notifications are posted to (``https://``, or ``http://`` to this machine);
unset or empty: no notifications."""
AUTOMATION_NAME = "neuron-flows: fine-tuning run failed"
BLOCK_NAME = "neuron-flows-failures"

SUBJECT = "Fine-tuning run {{ flow_run.name }} {{ flow_run.state.name }}"
BODY = """\
Run {{ flow_run.name }} of {{ flow.name }}/{{ deployment.name }} ended {{ flow_run.state.name }}.
{{ flow_run.state.message }}
Run page: {{ flow_run|ui_url }}
Retry: press Retry on the run page, or run `prefect flow-run retry {{ flow_run.id }}`. \
Steps that finished are not repeated, and training continues from the newest complete checkpoint."""
MAX_ERROR_CHARS = 2000
"""The longest error text a state message (and so a notification) quotes: its start and its end."""
WEBHOOK_JSON = {"text": "{{subject}}\n{{body}}", "subject": "{{subject}}", "body": "{{body}}"}
"""What the webhook receives: ``text`` for chat webhooks (Slack, Mattermost), plus the two parts."""


def failure_message(run_dir: str | Path, exc: BaseException, failed_step: str | None) -> str:
    """The state message of a failed run: failed step, last training step and loss, newest
    complete checkpoint (read from ``run_dir``), and the error."""
    from neuron_parallel.checkpoint import is_complete, list_checkpoints
    from neuron_parallel.reporting import read_metrics
    from neuron_parallel.run_files import METRICS_FILE

    run = Path(run_dir).resolve()
    metrics = run / METRICS_FILE
    steps = [r for r in read_metrics(metrics) if "loss" in r] if metrics.is_file() else []
    complete = [c for c in list_checkpoints(run) if is_complete(c)]
    last = f"{steps[-1]['step']}, loss {steps[-1]['loss']:.4f}" if steps else "none (no training step finished)"
    error = f"{type(exc).__name__}: {exc}"
    if len(error) > MAX_ERROR_CHARS:  # a failed launch quotes the ranks' output; the run's logs keep all of it
        half = MAX_ERROR_CHARS // 2
        error = f"{error[:half]}\n[… {len(error) - 2 * half} characters, in the run's logs …]\n{error[-half:]}"
    return "\n".join(
        [
            f"failed step: {failed_step or 'none (the flow failed outside its steps)'}",
            f"last step: {last}",
            f"newest complete checkpoint: {complete[-1] if complete else 'none'}",
            f"run directory: {run}",
            f"error: {error}",
        ]
    )


def failed_state(run_dir: str | Path, exc: Exception):
    """What a fine-tuning flow returns when a step raised ``exc``: a Failed state with
    :func:`failure_message` as its message and ``exc`` as its data. Prefect ends the flow run in
    it, and a direct call of the flow still raises ``exc`` itself."""
    from prefect import get_run_logger
    from prefect.runtime import flow_run
    from prefect.states import Failed

    from neuron_flows.tasks.common import failed_step

    get_run_logger().error("Encountered exception during execution:", exc_info=exc)
    return Failed(message=failure_message(run_dir, exc, failed_step(flow_run.get_id())), data=exc)


NOT_PROMOTED = "NotPromoted"
"""The name of the Completed state of a run whose model was not published (the evaluate step's gate)."""


def not_promoted_state(summary: dict, reason: str):
    """What a fine-tuning flow returns when the evaluate step's gate was not met: a Completed state
    named :data:`NOT_PROMOTED` with ``reason`` as its message and the run's ``summary`` as its
    data (what a direct call of the flow returns)."""
    from prefect.states import Completed

    return Completed(name=NOT_PROMOTED, message=reason, data=summary)


def webhook_url(value: str | None = None) -> str | None:
    """The webhook failure notifications are posted to: ``value``, default
    ``$NEURON_FLOWS_NOTIFY_WEBHOOK``; None when unset or empty. The URL is the webhook's
    credential, so it must be ``https://`` (``http://`` only to this machine), and a refusal
    (``ValueError``, naming the variable and the fix) shows it as ``redact_url`` does."""
    from neuron_parallel.urls import encrypted_or_local, redact_url

    url = (os.environ.get(WEBHOOK_ENV, "") if value is None else value).strip()
    if not url:
        return None
    if not encrypted_or_local(url):
        raise ValueError(
            f"{WEBHOOK_ENV}={redact_url(url)} is not an https:// URL; the webhook's URL is its credential and would "
            "travel unencrypted. Give its https:// address (http:// only to a receiver on this machine: 127.0.0.1, "
            f"localhost or ::1), or unset {WEBHOOK_ENV}"
        )
    return url


def _webhook_block(url: str):
    from prefect.blocks.notifications import CustomWebhookNotificationBlock

    # The URL of a chat webhook is its credential: kept among the block's secrets, so the API and
    # the UI show it masked, and filled into the request when the notification is sent.
    return CustomWebhookNotificationBlock(
        name=BLOCK_NAME, url="{{ webhook_url }}", json_data=WEBHOOK_JSON, secrets={"webhook_url": url}
    )


async def _delete_webhook_block() -> None:
    from prefect.blocks.notifications import CustomWebhookNotificationBlock

    try:
        await CustomWebhookNotificationBlock.adelete(BLOCK_NAME)
    except ValueError:  # Prefect's answer for no block of that name
        pass


def _automation(block_id, flow_names: list[str]):
    from datetime import timedelta

    from prefect.automations import Automation, EventTrigger, SendNotification

    return Automation(
        name=AUTOMATION_NAME,
        description=f"Posts to ${WEBHOOK_ENV} when a run of a fine-tuning deployment fails, crashes or is not "
        "promoted (its model kept from the Hub by the evaluation gate).",
        trigger=EventTrigger(
            expect={"prefect.flow-run.Failed", "prefect.flow-run.Crashed", f"prefect.flow-run.{NOT_PROMOTED}"},
            match={"prefect.resource.id": "prefect.flow-run.*"},
            # Every related resource spec must match: a run of one of these flows, from a deployment.
            match_related=[
                {"prefect.resource.role": "flow", "prefect.resource.name": flow_names},
                {"prefect.resource.role": "deployment"},
            ],
            for_each={"prefect.resource.id"},
            posture="Reactive",
            threshold=1,
            within=timedelta(0),
        ),
        actions=[SendNotification(block_document_id=block_id, subject=SUBJECT, body=BODY)],
    )


async def sync_failure_notifications(flow_names: list[str], webhook: str | None = None) -> bool:
    """Create or update the failure automation for runs of ``flow_names``' deployments when a
    webhook is given (default: ``$NEURON_FLOWS_NOTIFY_WEBHOOK``); without one, delete an automation
    an earlier registration made, so notifications are off. Returns whether they are on."""
    from prefect.automations import Automation

    webhook = webhook_url(webhook)
    try:
        existing = await Automation.aread(name=AUTOMATION_NAME)
    except ValueError:  # Prefect's answer for no automation of that name
        existing = None
    if not webhook:
        if existing is not None:
            await existing.adelete()
            await _delete_webhook_block()
        return False
    block_id = await _webhook_block(webhook).asave(BLOCK_NAME, overwrite=True)
    automation = _automation(block_id, sorted(set(flow_names)))
    if existing is None:
        await automation.acreate()
    else:
        automation.id = existing.id
        await automation.aupdate()
    return True
