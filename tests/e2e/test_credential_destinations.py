"""The operator decides where credentials go, and a refusal says so before anything starts:
`neuron-flows run` with HF_TOKEN set and a `hub.endpoint` the operator did not list exits 2 at
config load, naming NEURON_FLOWS_ALLOWED_HUB_ENDPOINTS, and no request reaches that endpoint;
`neuron-flows serve` with a plain-http webhook to another machine exits 2 before it starts a
server, without printing the webhook's URL."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from neuron_flows.flows.notify import WEBHOOK_ENV
from neuron_flows.tasks.config import ALLOWED_HUB_ENDPOINTS_ENV

from ..conftest import ROOT

CLI = Path(sys.executable).parent / "neuron-flows"
CONFIG = ROOT / "configs" / "tiny-llama-cpu.yaml"
LOAD_BOUND_S = 20.0


@pytest.fixture
def unlisted_hub():
    """An HTTP server on loopback that no list names, counting every request it gets."""
    requests: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            requests.append(f"{self.command} {self.path}")
            self.send_response(401)
            self.end_headers()

        do_POST = do_GET

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    server.requests = requests
    yield server
    server.shutdown()


@pytest.mark.parametrize("where", ["elsewhere", "this-machine"])
def test_an_endpoint_the_operator_did_not_list_is_refused_at_load(tiny_world, tmp_path, unlisted_hub, where):
    endpoint = "https://evil.example" if where == "elsewhere" else f"http://127.0.0.1:{unlisted_hub.server_port}"
    token = "hf_" + secrets.token_hex(20)
    sets = {
        "model.name_or_path": tiny_world["model"],
        "data.source": tiny_world["corpus"],
        "data.cache_dir": tmp_path / "datasets",
        "output.dir": tmp_path / "run",
        "hub.repo_id": "alice/ft",
        "hub.endpoint": endpoint,
    }
    cmd = [str(CLI), "run", str(CONFIG), *(x for k, v in sets.items() for x in ("--set", f"{k}={v}"))]
    env = {**os.environ, "HF_TOKEN": token, "PREFECT_HOME": str(tmp_path / "prefect")}
    env.pop("HF_ENDPOINT", None)
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=LOAD_BOUND_S, cwd=ROOT, env=env)
    elapsed = time.monotonic() - t0
    print(f"ENDPOINT {where}: refused in {elapsed:.1f} s: {proc.stderr.strip()}")
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    assert proc.stderr.startswith(f"error: invalid config: hub.endpoint: '{endpoint}' is not a Hub endpoint")
    assert f"adds {endpoint} to {ALLOWED_HUB_ENDPOINTS_ENV} in the environment" in proc.stderr
    assert token not in proc.stdout + proc.stderr
    assert unlisted_hub.requests == []  # the token never left this process
    assert not [p for p in tmp_path.iterdir()]  # no run, no dataset, no Prefect home


def test_serve_refuses_a_webhook_without_tls_before_starting(tmp_path):
    key = secrets.token_hex(16)
    env = {**os.environ, WEBHOOK_ENV: f"http://hooks.example.com/services/{key}"}
    env.pop("PREFECT_API_URL", None)
    cmd = [str(CLI), "serve", "--port", "9", "--home", str(tmp_path / "home")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT, env=env)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stderr == (
        f"error: {WEBHOOK_ENV}=http://hooks.example.com/… is not an https:// URL; the webhook's URL is its "
        "credential and would travel unencrypted. Give its https:// address (http:// only to a receiver on this "
        f"machine: 127.0.0.1, localhost or ::1), or unset {WEBHOOK_ENV}\n"
    )
    assert key not in proc.stdout + proc.stderr
    assert not (tmp_path / "home").exists()  # no Prefect server, no database
