"""What the service tests share: a `neuron-flows serve` subprocess with a small client of its REST
API (the calls the UI makes), deployment parameters for short runs, and /proc helpers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from neuron_parallel.procs import (
    alive,  # noqa: F401 (the service tests take it from here)
    die_with_parent,
)

from ..conftest import ROOT, port_outside_the_ephemeral_range

TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


class _RetryingClient(httpx.Client):
    """Retries 502/503 as Prefect's own client and UI do: the server answers 503 to errors a
    client should retry, such as a SQLite write lock held too long on a busy machine."""

    def request(self, *args, **kwargs):
        for attempt in range(6):
            response = super().request(*args, **kwargs)
            if response.status_code not in (502, 503):
                return response
            time.sleep(0.5 * 2**attempt)
        return response


class Service:
    """A `neuron-flows serve` subprocess and a small client of its REST API."""

    def __init__(self, home: Path, extra_env: dict[str, str] | None = None) -> None:
        # Below the ephemeral range: a port bind(("", 0)) hands out can be taken by an outgoing
        # connection (a rank's, a client's) before the server binds it.
        self.port = port_outside_the_ephemeral_range()
        self.ui = f"http://127.0.0.1:{self.port}"
        self.api = f"{self.ui}/api"
        self.home = home
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PREFECT_WORKER_QUERY_SECONDS": "2",
            "PREFECT_RUNNER_POLL_FREQUENCY": "2",
            "PREFECT_LOGGING_LEVEL": "INFO",
            **(extra_env or {}),
        }
        env.pop("PREFECT_API_URL", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "neuron_flows.flows.cli", "serve", "--port", str(self.port), "--home", str(home)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            preexec_fn=die_with_parent(os.getpid()),  # a pytest killed outright takes the service with it
        )
        self.lines: list[str] = []
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        if not self.ready.wait(300):
            self.stop()
            raise AssertionError("serve did not come up:\n" + "\n".join(self.lines[-60:]))
        self.http = _RetryingClient(base_url=self.api, timeout=30)

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())
            if line.startswith("worker:"):
                self.ready.set()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # what Ctrl-C sends
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                from neuron_parallel.procs import kill_tree

                kill_tree(self.proc, grace_s=0)
        return self.proc.returncode

    def deployment(self, name: str) -> dict:
        r = self.http.get(f"/deployments/name/finetune/{name}")
        r.raise_for_status()
        return r.json()

    def run_deployment(self, name: str, config: dict, job_variables: dict | None = None) -> dict:
        dep = self.deployment(name)
        r = self.http.post(
            f"/deployments/{dep['id']}/create_flow_run",
            json={"parameters": {"config": config}, "job_variables": job_variables or {}},
        )
        r.raise_for_status()
        return r.json()

    def flow_run(self, run_id: str) -> dict:
        r = self.http.get(f"/flow_runs/{run_id}")
        r.raise_for_status()
        return r.json()

    def wait(self, run_id: str, states=TERMINAL, timeout: float = 420) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            run = self.flow_run(run_id)
            if run["state"]["type"] in states:
                return run
            time.sleep(1)
        raise AssertionError(
            f"flow run {run_id} still {run['state']['name']} after {timeout:.0f} s; serve output:\n"
            + "\n".join(self.lines[-40:])
        )

    def task_runs(self, run_id: str) -> dict[str, dict]:
        """The latest task run of each task of the flow run, by task name (tokenize, plan, ...)."""
        r = self.http.post(
            "/task_runs/filter", json={"flow_runs": {"id": {"any_": [run_id]}}, "sort": "EXPECTED_START_TIME_ASC"}
        )
        r.raise_for_status()
        latest = {}
        for t in sorted(r.json(), key=lambda t: t["created"]):
            latest[t["name"].rsplit("-", 1)[0]] = t
        return latest

    def logs(self, run_id: str) -> list[str]:
        out, offset = [], 0
        while True:
            r = self.http.post(
                "/logs/filter",
                json={
                    "logs": {"flow_run_id": {"any_": [run_id]}},
                    "limit": 200,
                    "offset": offset,
                    "sort": "TIMESTAMP_ASC",
                },
            )
            r.raise_for_status()
            page = [log["message"] for log in r.json()]
            out += page
            if len(page) < 200:
                return out
            offset += 200

    def artifacts(self, run_id: str) -> list[dict]:
        r = self.http.post("/artifacts/filter", json={"artifacts": {"flow_run_id": {"any_": [run_id]}}})
        r.raise_for_status()
        return r.json()


def run_dir(svc: Service, run: dict) -> Path:
    path = ROOT / ".runs" / run["name"]
    svc.made.append(path)
    return path


def small(tiny: dict | None = None, **train) -> dict:
    """Deployment parameters for a short run (what a user would type into the form)."""
    return {
        "launch": {"device": "cpu", "nproc_per_node": 2, "retries": 0},
        "data": {"block_size": 32},
        "train": {"max_steps": 8, "save_every": 4, "micro_batch_size": 4, "lr": 3e-3, **train},
        "output": {"dir": ".runs/{flow_run_name}"},
        **(tiny or {}),
    }


def processes() -> list[tuple[int, str]]:
    out = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                cmd = Path(entry.path, "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                state = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if state != "Z":
                out.append((int(entry.name), cmd))
    return out


def environ(pid: int) -> dict[str, str]:
    """The environment ``pid`` started with; empty if it is gone."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
    except OSError:
        return {}
    return dict(kv.split("=", 1) for kv in raw.split("\0") if "=" in kv)


def service_processes(svc: Service) -> list[tuple[int, str]]:
    """Live processes started for ``svc``: serve gives its PREFECT_HOME to the server and the
    worker, and through the worker to flow runs, torchrun and the ranks."""
    home = str(svc.home.resolve())
    return [(pid, cmd) for pid, cmd in processes() if environ(pid).get("PREFECT_HOME") == home]


def run_processes(svc: Service, run_id: str) -> list[tuple[int, str]]:
    """Live processes of one flow run: its flow-run process, torchrun and the ranks (the worker
    sets PREFECT__FLOW_RUN_ID, and each starts its children with its own environment)."""
    return [(pid, cmd) for pid, cmd in service_processes(svc) if environ(pid).get("PREFECT__FLOW_RUN_ID") == run_id]


def metric_steps(path: Path) -> list[int]:
    """The steps recorded in a run directory's metrics.jsonl, in file order."""
    import json

    out = []
    for line in (path / "metrics.jsonl").read_text().splitlines() if (path / "metrics.jsonl").exists() else ():
        try:
            out.append(json.loads(line)["step"])
        except (ValueError, KeyError):
            continue  # a record cut short by a kill
    return out
