"""Failure notifications: `neuron-flows serve` with NEURON_FLOWS_NOTIFY_WEBHOOK set creates a Prefect
automation, and a run of finetune/local that fails in training makes the Prefect server post the run's
name, the failed step, the last step and its loss, the newest complete checkpoint and how to retry to
that webhook: here an http.server in the test."""

from __future__ import annotations

import json
import queue
import threading
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from neuron_flows.flows.notify import AUTOMATION_NAME, WEBHOOK_ENV
from neuron_parallel.reporting import read_metrics
from neuron_parallel.train import FAIL_AFTER_ENV

from .service_helpers import run_dir, small


class Receiver:
    """A webhook on loopback: every JSON body POSTed to it, with the time it came, in arrival order."""

    def __init__(self) -> None:
        received: queue.Queue = queue.Queue()

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                received.put((datetime.now(UTC), body))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.received = received
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/hooks/neuron-flows"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def next(self, timeout: float) -> tuple[datetime, dict]:
        try:
            return self.received.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"the webhook received nothing within {timeout:.0f} s") from None


@pytest.fixture(scope="module")
def receiver():
    r = Receiver()
    yield r
    r.server.shutdown()


@pytest.fixture(scope="module")
def service_env(receiver) -> dict[str, str]:
    return {WEBHOOK_ENV: receiver.url}


@pytest.mark.slow
def test_a_failed_run_posts_its_step_loss_checkpoint_and_retry_to_the_webhook(service, receiver):
    assert any(line.startswith("failure notifications: on") for line in service.lines), service.lines[-20:]
    run = service.run_deployment("local", small(), job_variables={"env": {FAIL_AFTER_ENV: "4"}})
    out = run_dir(service, run)
    failed = service.wait(run["id"])
    assert failed["state"]["type"] == "FAILED", failed["state"]
    came, message = receiver.next(timeout=60)
    delay = (came - datetime.fromisoformat(failed["state"]["timestamp"])).total_seconds()
    print(f"NOTIFY: the webhook had the message {delay:.1f} s after the run turned Failed:")
    print(message["text"])
    assert delay < 60

    last = [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r][-1]
    newest = out.resolve() / "checkpoint-4"
    assert (newest / "COMPLETE").exists() and not (out / "checkpoint-8").exists()
    assert message["subject"] == f"Fine-tuning run {run['name']} Failed"
    body = message["body"]
    assert body.startswith(f"Run {run['name']} of finetune/local ended Failed.\n"), body
    assert "\nfailed step: train\n" in body, body
    assert f"\nlast step: {last['step']}, loss {last['loss']:.4f}\n" in body, body
    assert f"\nnewest complete checkpoint: {newest}\n" in body, body
    assert "\nerror: TrainingFailed: torchrun exited with code" in body, body
    assert f"\nRun page: {service.ui}/runs/flow-run/{run['id']}\n" in body, body
    assert f"`prefect flow-run retry {run['id']}`" in body, body
    assert message["text"] == f"{message['subject']}\n{body}"
    # The same report is the run's state message, on its page in the UI.
    assert failed["state"]["message"].startswith("failed step: train\n") and failed["state"]["message"] in body

    # Without the webhook, registering again turns the notifications off.
    import asyncio

    from prefect.settings import PREFECT_API_URL, temporary_settings

    from neuron_flows.flows.notify import sync_failure_notifications

    automations = service.http.post("/automations/filter", json={}).json()
    assert [a["name"] for a in automations] == [AUTOMATION_NAME]
    with temporary_settings({PREFECT_API_URL: service.api}):
        assert asyncio.run(sync_failure_notifications(["finetune"], webhook="")) is False
    assert service.http.post("/automations/filter", json={}).json() == []
