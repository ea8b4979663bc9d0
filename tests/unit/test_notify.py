"""What a failed fine-tuning run reports (flows/notify.py), read from a real run directory, and which
events the failure automation's trigger takes, judged by the Prefect server's own trigger model. No
server and no processes: tests/e2e/test_notifications.py runs the whole path."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime

from neuron_flows.flows.notify import _automation, failure_message
from neuron_parallel.checkpoint.format import COMPLETE, MANIFEST


def test_the_report_names_the_step_the_last_loss_and_the_newest_complete_checkpoint(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    records = [{"step": s, "loss": 3.0 - 0.25 * s} for s in range(1, 6)] + [{"step": 4, "eval_loss": 2.5}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + '{"step": 6, "lo')
    for step, complete in ((2, True), (4, True), (6, False)):  # checkpoint-6: cut short, not complete
        ckpt = run / f"checkpoint-{step}"
        ckpt.mkdir()
        (ckpt / MANIFEST).write_text("{}")
        if complete:
            (ckpt / COMPLETE).write_text("")
    message = failure_message(run, RuntimeError("torchrun exited with code 1"), "train")
    assert message.splitlines() == [
        "failed step: train",
        "last step: 5, loss 1.7500",
        f"newest complete checkpoint: {run.resolve() / 'checkpoint-4'}",
        f"run directory: {run.resolve()}",
        "error: RuntimeError: torchrun exited with code 1",
    ]


def test_the_report_of_a_run_that_failed_before_training(tmp_path):
    message = failure_message(tmp_path / "never-made", ValueError("data.source: no such file"), None)
    assert message.splitlines()[:3] == [
        "failed step: none (the flow failed outside its steps)",
        "last step: none (no training step finished)",
        "newest complete checkpoint: none",
    ]
    assert not (tmp_path / "never-made").exists()


def _event(name: str, flow: str = "finetune", deployment: bool = True):
    from prefect.server.events.schemas.events import ReceivedEvent

    run_id = uuid.uuid4()
    related = [{"prefect.resource.id": f"prefect.flow.{uuid.uuid4()}", "prefect.resource.role": "flow"}]
    related[0]["prefect.resource.name"] = flow
    if deployment:
        related.append(
            {
                "prefect.resource.id": f"prefect.deployment.{uuid.uuid4()}",
                "prefect.resource.role": "deployment",
                "prefect.resource.name": "local",
            }
        )
    kind = name.rsplit(".", 1)[0]  # prefect.flow-run or prefect.task-run
    return ReceivedEvent(
        occurred=datetime.now(UTC),
        event=name,
        resource={"prefect.resource.id": f"{kind}.{run_id}", "prefect.resource.name": "brave-otter"},
        related=related,
        id=uuid.uuid4(),
    )


def test_the_trigger_takes_failed_crashed_and_not_promoted_runs_of_the_deployments_only():
    from prefect.server.events.schemas.automations import EventTrigger

    client_side = _automation(uuid.uuid4(), ["finetune"]).trigger
    trigger = EventTrigger.model_validate(client_side.model_dump(mode="json"))
    assert trigger.immediate  # one event fires it, at once
    assert trigger.covers(_event("prefect.flow-run.Failed"))
    assert trigger.covers(_event("prefect.flow-run.Crashed"))
    assert trigger.covers(_event("prefect.flow-run.NotPromoted"))  # Completed, its model kept off the Hub
    assert not trigger.covers(_event("prefect.flow-run.Completed"))
    assert not trigger.covers(_event("prefect.flow-run.Cancelled"))
    assert not trigger.covers(_event("prefect.task-run.Failed"))  # a step that fails and is retried
    assert not trigger.covers(_event("prefect.flow-run.Failed", deployment=False))  # `neuron-flows run`
    assert not trigger.covers(_event("prefect.flow-run.Failed", flow="another-flow"))
