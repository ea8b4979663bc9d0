"""The pipeline as a service: `neuron-flows serve` (a real Prefect server on loopback, the
deployments of deployments/prefect.yaml, a process worker), driven through the UI in Debian's
chromium and through the same REST calls the UI makes.

The deployment `finetune/local` runs with its working directory at the repository root, so its
default parameters read `.tiny/` there (created if missing, as `make demo` does) and write under
`.runs/`; every run directory a test makes is removed afterwards.
"""

from __future__ import annotations

import json
import queue
import secrets
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from neuron_flows.flows.notify import WEBHOOK_ENV

from ..conftest import HUB_PORT, ROOT
from ..hub_server import LocalHub
from .service_helpers import TERMINAL, alive, processes, run_dir, small

CHROMIUM = "/usr/bin/chromium"
SCREENSHOTS = ROOT / ".runs" / "test-output"
HF_TOKEN = "hf_" + secrets.token_hex(20)
"""The service's HF_TOKEN: a run whose config names no token_secret uploads with it."""
WEBHOOK_KEY = secrets.token_hex(16)
"""The secret path of the service's failure webhook (a chat webhook's URL is its credential)."""


@pytest.fixture(scope="module")
def webhook():
    """A failure webhook on loopback at ``/hooks/<WEBHOOK_KEY>``: a queue of (path, JSON body)."""
    received: queue.Queue = queue.Queue()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            received.put((self.path, json.loads(self.rfile.read(int(self.headers["Content-Length"])))))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    server.received = received
    server.url = f"http://127.0.0.1:{server.server_port}/hooks/{WEBHOOK_KEY}"
    yield server
    server.shutdown()


@pytest.fixture(scope="module")
def service_env(webhook) -> dict[str, str]:
    return {"HF_TOKEN": HF_TOKEN, WEBHOOK_ENV: webhook.url}


def _files(*roots: Path):
    for root in roots:
        yield from (p for p in root.rglob("*") if p.is_file() and not p.is_symlink())


def test_serve_registers_the_deployments(service):
    local, trn2 = service.deployment("local"), service.deployment("trn2")
    assert local["work_pool_name"] == "local" and trn2["work_pool_name"] == "trn2"
    assert local["pull_steps"][0]["prefect.deployments.steps.set_working_directory"]["directory"] == str(ROOT)
    # The UI's form is the config model: nested sections with typed fields and defaults.
    schema = local["parameter_openapi_schema"]
    assert "config" in schema["properties"] and "ParallelSection" in schema["definitions"]
    assert schema["definitions"]["TrainSection"]["properties"]["max_steps"]["default"] == 100
    cron = trn2["schedules"][0]
    assert cron["schedule"]["cron"] == "0 2 * * *" and cron["active"] is False
    pools = {p["name"]: p for p in service.http.post("/work_pools/filter", json={}).json()}
    assert pools["local"]["type"] == "process" and pools["trn2"]["type"] == "kubernetes"
    assert pools["trn2"]["base_job_template"]["job_configuration"]["job_manifest"]["kind"] == "Job"


def test_ui_quick_run_completes_with_a_consolidated_model(service):
    """Open the deployment in the UI, Run → Quick run (the deployment's defaults), and the run
    completes with a consolidated model. Every non-loopback request of the page is blocked."""
    assert Path(CHROMIUM).exists(), "Debian's chromium is missing: apt-get install chromium (make test does)"
    from playwright.sync_api import sync_playwright

    dep = service.deployment("local")
    before = {r["id"] for r in service.http.post("/flow_runs/filter", json={}).json()}
    blocked: list[str] = []

    def gate(route):
        url = route.request.url
        if url.startswith(("http://127.0.0.1", "data:", "blob:")):
            return route.continue_()
        blocked.append(url)
        return route.abort()

    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM,
            headless=True,
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
            ],
        )
        page = browser.new_context(viewport={"width": 1400, "height": 900}).new_page()
        page.context.route("**/*", gate)
        page.goto(f"{service.ui}/deployments/deployment/{dep['id']}", wait_until="networkidle")
        page.get_by_role("button", name="Run", exact=True).click()
        quick = page.get_by_text("Quick run").first
        quick.wait_for(timeout=20_000)
        quick.click()
        # The UI answers with a toast naming the new run: "<name> scheduled to start now".
        toast = page.get_by_text("scheduled to start").first
        try:
            toast.wait_for(timeout=60_000)
        except Exception:
            page.screenshot(path=str(SCREENSHOTS / "ui-quick-run-failed.png"), full_page=True)
            raise AssertionError(
                "no confirmation after Quick run (screenshot ui-quick-run-failed.png); server:\n"
                + "\n".join(service.lines[-30:])
            ) from None
        name = toast.inner_text().split(" scheduled to start")[0].strip().split()[-1]
        new = service.http.post("/flow_runs/filter", json={"flow_runs": {"name": {"any_": [name]}}}).json()
        assert new and new[0]["id"] not in before, (name, new)
        run = new[0]
        out_dir = run_dir(service, run)
        assert run["deployment_id"] == dep["id"]
        final = service.wait(run["id"])
        page.goto(f"{service.ui}/runs/flow-run/{run['id']}", wait_until="networkidle")
        page.get_by_text("Completed").first.wait_for(timeout=20_000)
        page.screenshot(path=str(SCREENSHOTS / "ui-quick-run.png"), full_page=True)
        # The summary artifact shows the loss curve as a real image.
        summary = next(a for a in service.artifacts(run["id"]) if a["key"] == "summary")
        page.goto(f"{service.ui}/artifacts/artifact/{summary['id']}", wait_until="networkidle")
        img = page.locator("img[src^='data:image/png']").first
        img.wait_for(timeout=20_000)
        width = img.evaluate("el => el.complete ? el.naturalWidth : 0")
        page.screenshot(path=str(SCREENSHOTS / "ui-summary.png"), full_page=True)
        browser.close()
    assert width > 300, "the loss curve did not render in the UI"
    assert final["state"]["type"] == "COMPLETED", final["state"]
    assert (out_dir / "consolidated" / "model.safetensors").stat().st_size > 1_000_000
    assert (out_dir / "checkpoint-40" / "COMPLETE").exists()
    keys = {a["key"] for a in service.artifacts(run["id"])}
    assert {"plan", "train-progress", "summary"} <= keys
    assert all(not u.startswith("http://127.0.0.1") for u in blocked)


def _soon(seconds: float) -> str:
    """An ISO timestamp ``seconds`` from now, a minute back: an interval schedule's next slot."""
    import datetime

    now = datetime.datetime.now(datetime.UTC)
    return (now + datetime.timedelta(seconds=seconds - 60)).isoformat()


@pytest.mark.slow
def test_one_minute_schedule_creates_a_run_a_worker_completes(service):
    import asyncio

    from prefect.settings import PREFECT_API_URL, temporary_settings

    from neuron_flows.flows.serve import load_spec, register

    local = next(d for d in load_spec()["deployments"] if d["name"] == "local")
    every_minute = {
        **local,
        "name": "every-minute",
        "parameters": {"config": small()},
        # Every 60 s, anchored so that the first slot falls a few seconds from now (a cron of
        # "* * * * *" would wait for the next whole minute).
        "schedules": [{"interval": 60, "anchor_date": _soon(20), "timezone": "UTC"}],
    }
    with temporary_settings({PREFECT_API_URL: service.api}):
        asyncio.run(register({"deployments": [every_minute]}))
    dep = service.deployment("every-minute")
    try:
        deadline = time.monotonic() + 240
        runs = []
        while time.monotonic() < deadline and not runs:
            runs = service.http.post(
                "/flow_runs/filter",
                json={"deployments": {"id": {"any_": [dep["id"]]}}, "sort": "EXPECTED_START_TIME_ASC"},
            ).json()
            time.sleep(2)
        assert runs, "the schedule created no run"
        first = runs[0]
        assert first["auto_scheduled"] is True
        run_dir(service, first)
        done = service.wait(first["id"])
        assert done["state"]["type"] == "COMPLETED", done["state"]
        assert (run_dir(service, first) / "consolidated" / "model.safetensors").exists()
    finally:
        service.http.delete(f"/deployments/{dep['id']}")
        for run in service.http.post("/flow_runs/filter", json={"deployments": {"id": {"any_": [dep["id"]]}}}).json():
            run_dir(service, run)


def test_retry_resumes_from_the_checkpoint_and_secrets_stay_secret(service, webhook, tmp_path):
    """Training dies after its first complete checkpoint (step 4). The UI's Retry call reruns the
    same flow run: tokenize and plan come back Cached, training resumes from step 4, and the
    final weights equal those of a run that never failed. That reference run uploads with a token
    from a Secret block, the retried run with the service's HF_TOKEN, and the failure went to the
    webhook. Afterwards none of the three secrets (the two tokens, the webhook's URL) is in any
    file the runs wrote, the Prefect home (its database included) or the Hub's storage, nor in
    serve's output; the runs' logs and artifacts hold no token, and the uploads no local path."""
    from prefect.blocks.system import Secret
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from safetensors.torch import load_file

    token = "hf_" + secrets.token_hex(20)
    with LocalHub(tmp_path / "hub", users={token: "alice", HF_TOKEN: "alice"}, port=HUB_PORT) as hub:
        with temporary_settings({PREFECT_API_URL: service.api}):
            Secret(value=token).save("hf-token-test", overwrite=True)
        crashing = service.run_deployment(
            "local",
            {**small(), "hub": {"repo_id": "alice/tiny-retried", "endpoint": hub.url}},
            job_variables={"env": {"NEURON_FLOWS_FAIL_AFTER_STEP": "4"}},
        )
        clean = service.run_deployment(
            "local",
            {**small(), "hub": {"repo_id": "alice/tiny-ft", "endpoint": hub.url, "token_secret": "hf-token-test"}},
        )
        failed = service.wait(crashing["id"])
        assert failed["state"]["type"] == "FAILED", failed["state"]
        crash_dir = run_dir(service, crashing)
        assert (crash_dir / "checkpoint-4" / "COMPLETE").exists() and not (crash_dir / "checkpoint-8").exists()
        first_tasks = service.task_runs(crashing["id"])
        assert first_tasks["train"]["state"]["type"] == "FAILED"

        # The UI's Retry button.
        r = service.http.post(
            f"/flow_runs/{crashing['id']}/set_state",
            json={"state": {"type": "SCHEDULED", "name": "AwaitingRetry"}, "force": True},
        )
        assert r.status_code in (200, 201), r.text
        retried = service.wait(crashing["id"], states={"COMPLETED", "FAILED", "CRASHED", "CANCELLED"})
        deadline = time.monotonic() + 420  # the first wait may see the old FAILED state before the retry starts
        while retried["run_count"] < 2 or retried["state"]["type"] not in TERMINAL:
            assert time.monotonic() < deadline, retried["state"]
            time.sleep(1)
            retried = service.flow_run(crashing["id"])
        assert retried["state"]["type"] == "COMPLETED", retried["state"]
        tasks = service.task_runs(crashing["id"])
        assert tasks["tokenize"]["state"]["name"] == "Cached" and tasks["plan"]["state"]["name"] == "Cached"
        assert tasks["train"]["state"]["name"] == "Completed"
        logs = service.logs(crashing["id"])
        assert any("resumed from step 4" in line for line in logs), logs[-30:]

        done = service.wait(clean["id"])
        assert done["state"]["type"] == "COMPLETED", done["state"]
        clean_dir = run_dir(service, clean)
        a = load_file(crash_dir / "consolidated" / "model.safetensors")
        b = load_file(clean_dir / "consolidated" / "model.safetensors")
        assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)

        # The secret: used for a real upload, then nowhere in what the server keeps.
        assert hub.root.joinpath("repos").exists()
        needle = token.encode()
        dbs = list(service.home.glob("prefect.db*"))
        assert dbs and sum(db.stat().st_size for db in dbs) > 100_000, dbs  # the server's SQLite files
        for db in dbs:
            assert needle not in db.read_bytes(), db
        for run in (clean, crashing):
            assert not any(token in line for line in service.logs(run["id"]))
            for art in service.artifacts(run["id"]):
                assert token not in str(art.get("data")) and token not in str(art.get("description"))
            assert token not in service.http.get(f"/flow_runs/{run['id']}").text

        # Each secret was used: both repos were written to, and the failure went to the webhook.
        assert {p.stem for p in (hub.root / "repos" / "model" / "alice").iterdir()} == {"tiny-ft", "tiny-retried"}
        deadline, posted = time.monotonic() + 60, []
        while not any(crashing["name"] in body["subject"] for _, body in posted):
            assert time.monotonic() < deadline, f"the webhook received no notification of {crashing['name']}"
            try:
                posted.append(webhook.received.get(timeout=1))
            except queue.Empty:
                pass
        assert {path for path, _ in posted} == {f"/hooks/{WEBHOOK_KEY}"}
        wanted = {"HF_TOKEN": HF_TOKEN, "the Secret block's token": token, "the webhook's URL": WEBHOOK_KEY}
        places = [crash_dir, clean_dir, ROOT / ".runs" / "datasets", service.home, hub.root]
        searched, leaks = 0, []
        for path in _files(*places):
            data, searched = path.read_bytes(), searched + 1
            leaks += [f"{name} in {path}" for name, value in wanted.items() if value.encode() in data]
            if path.is_relative_to(hub.root) and str(ROOT).encode() in data:
                leaks.append(f"a local path ({ROOT}) in the Hub's {path.relative_to(hub.root)}")
        output = "\n".join(service.lines)
        leaks += [f"{name} in serve's output" for name, value in wanted.items() if value in output]
        print(f"SECRETS: {len(wanted)} secrets searched for in {searched} files and {len(service.lines)} lines")
        assert not leaks, leaks


def test_a_run_cannot_allow_a_hub_endpoint_through_its_job_variables(service):
    """The worker passes a run's job variables ``env`` to the run's process, so a run started with
    NEURON_FLOWS_ALLOWED_HUB_ENDPOINTS among them would pass the config's check: the run fails in
    preflight, before the token is read, naming the variable."""
    from neuron_flows.tasks.config import ALLOWED_HUB_ENDPOINTS_ENV

    hub = {"repo_id": "alice/x", "endpoint": "https://evil.example"}
    env = {ALLOWED_HUB_ENDPOINTS_ENV: "https://evil.example"}
    run = service.run_deployment("local", {**small(), "hub": hub}, job_variables={"env": env})
    out = run_dir(service, run)
    final = service.wait(run["id"])
    assert final["state"]["type"] == "FAILED", final["state"]
    message = final["state"]["message"]
    assert message.startswith("failed step: preflight\n"), message
    assert f"job variables set {ALLOWED_HUB_ENDPOINTS_ENV}: where the Hub token may go" in message
    assert not out.exists()


def test_cancel_ends_the_whole_process_tree(service):
    run = service.run_deployment("local", small(max_steps=100_000, save_every=0))
    run_dir(service, run)
    job = f"{run['name']}/job.json"  # torchrun and the ranks get the path relative to the repository
    deadline = time.monotonic() + 300
    ranks: list[int] = []
    state = service.flow_run(run["id"])["state"]
    while time.monotonic() < deadline and len(ranks) < 2 and state["type"] not in TERMINAL:
        ranks = [
            pid
            for pid, cmd in processes()
            if "neuron_parallel.train" in cmd and job in cmd and "torch.distributed.run" not in cmd
        ]
        time.sleep(1)
        state = service.flow_run(run["id"])["state"]
    assert len(ranks) == 2, (
        f"the training ranks never started; the run is {state['name']}: {state.get('message')}\n"
        + "\n".join(service.logs(run["id"])[-30:] + service.lines[-30:])
    )
    tree = [pid for pid, cmd in processes() if job in cmd]
    r = service.http.post(f"/flow_runs/{run['id']}/set_state", json={"state": {"type": "CANCELLING"}, "force": True})
    assert r.status_code in (200, 201), r.text
    t0 = time.monotonic()
    while time.monotonic() - t0 < 30 and any(alive(pid) for pid in tree):
        time.sleep(0.2)
    elapsed = time.monotonic() - t0
    left = [(pid, cmd) for pid, cmd in processes() if job in cmd]
    print(f"cancel: {len(tree)} processes of the run gone {elapsed:.1f} s after the cancel request")
    assert not left, left
    assert elapsed <= 10 + 4, f"processes of the run lived {elapsed:.1f} s after the cancel"  # worker poll: 2 s
    final = service.wait(run["id"])
    assert final["state"]["type"] == "CANCELLED", final["state"]
