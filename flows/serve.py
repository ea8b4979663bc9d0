"""``neuron-flows serve``: a local Prefect server, the work pools and deployments of
``deployments/prefect.yaml``, and a worker for the ``local`` pool, in one command.

    neuron-flows serve [--host 127.0.0.1] [--port 4200] [--home .runs/prefect]

The server keeps its SQLite database under ``--home``, listens on loopback only (Prefect's API
has no authentication), and has telemetry off. Everything started here runs in its own process
group and is stopped by Ctrl-C or SIGTERM, children first. ``--register-only`` registers pools
and deployments on the server at ``PREFECT_API_URL`` and exits.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
DEPLOYMENTS = ROOT / "deployments" / "prefect.yaml"
_ENV_REF = re.compile(r"\{\{\s*\$([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")


def _fill_env(value):
    """``{{ $NAME }}`` → the environment variable NAME, recursively (as ``prefect deploy`` does);
    ``NEURON_FLOWS_ROOT`` defaults to this repository's root."""
    if isinstance(value, str):

        def sub(m):
            env = {"NEURON_FLOWS_ROOT": str(ROOT), **os.environ}
            if m.group(1) not in env:
                raise ValueError(f"{DEPLOYMENTS.name} refers to ${m.group(1)}, which is not set")
            return env[m.group(1)]

        return _ENV_REF.sub(sub, value)
    if isinstance(value, list):
        return [_fill_env(v) for v in value]
    if isinstance(value, dict):
        return {k: _fill_env(v) for k, v in value.items()}
    return value


def load_spec(path: Path = DEPLOYMENTS) -> dict:
    return _fill_env(yaml.safe_load(path.read_text()))


async def register(spec: dict, base: Path = DEPLOYMENTS.parent) -> list[str]:
    """Create or update the spec's work pools and deployments; returns ``flow/deployment`` names."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import DeploymentScheduleCreate, WorkPoolCreate
    from prefect.client.schemas.schedules import construct_schedule
    from prefect.flows import load_flow_from_entrypoint
    from prefect.utilities.callables import parameter_schema
    from prefect.workers.process import ProcessWorker

    names = []
    async with get_client() as client:
        for pool in spec.get("work_pools", []):
            if "base_job_template" in pool:
                template = json.loads((base / pool["base_job_template"]).read_text())
            elif pool["type"] == "process":
                template = ProcessWorker.get_default_base_job_template()
            else:
                raise ValueError(f"work pool {pool['name']}: give base_job_template for type {pool['type']}")
            await client.create_work_pool(
                WorkPoolCreate(name=pool["name"], type=pool["type"], base_job_template=template), overwrite=True
            )
        for dep in spec["deployments"]:
            flow = load_flow_from_entrypoint(str(ROOT / dep["entrypoint"]))
            flow_id = await client.create_flow_from_name(flow.name)
            schedules = []
            for s in dep.get("schedules") or []:
                s = dict(s)
                active = s.pop("active", True)
                schedules.append(DeploymentScheduleCreate(schedule=construct_schedule(**s), active=active))
            await client.create_deployment(
                flow_id=flow_id,
                name=dep["name"],
                description=dep.get("description"),
                tags=dep.get("tags", []),
                work_pool_name=dep["work_pool"]["name"],
                job_variables=dep["work_pool"].get("job_variables") or {},
                entrypoint=dep["entrypoint"],
                pull_steps=dep.get("pull"),
                parameters=dep.get("parameters") or {},
                parameter_openapi_schema=parameter_schema(flow).model_dump_for_openapi(),
                enforce_parameter_schema=True,
                schedules=schedules,
            )
            names.append(f"{flow.name}/{dep['name']}")
    return names


def _wait_healthy(api: str, proc: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the Prefect server exited with code {proc.returncode}; see its output above")
        try:
            with urllib.request.urlopen(f"{api}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the Prefect server did not answer at {api}/health within {timeout:.0f} s")


def _die_with_parent() -> None:
    """In the child before exec (Linux): SIGTERM when ``serve`` dies, even by SIGKILL, so no
    server or worker outlives it."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _start(cmd: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen(
        cmd, env=env, cwd=ROOT, start_new_session=True, preexec_fn=_die_with_parent if sys.platform == "linux" else None
    )


def _stop(procs: list[subprocess.Popen]) -> None:
    from neuron_parallel.launch import kill_tree

    for proc in procs:  # the worker (and any flow run it started) first, then the server
        kill_tree(proc)


def serve(host: str, port: int, home: Path, worker: bool = True) -> int:
    if host not in ("127.0.0.1", "localhost", "::1"):
        print(
            f"warning: binding {host}: Prefect's API has no authentication; anyone who can reach it can run "
            "flows and read parameters",
            file=sys.stderr,
        )
    home.mkdir(parents=True, exist_ok=True)
    api = f"http://{host}:{port}/api"
    env = {
        **os.environ,
        "PREFECT_HOME": str(home.resolve()),
        "PREFECT_API_URL": api,
        "PREFECT_SERVER_API_HOST": host,
        "PREFECT_SERVER_API_PORT": str(port),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "1",
        # Training saturates small machines; give SQLite writes longer than the 10 s default
        # before the server answers 503.
        "PREFECT_SERVER_DATABASE_TIMEOUT": os.environ.get("PREFECT_SERVER_DATABASE_TIMEOUT", "30"),
        "NEURON_FLOWS_ROOT": str(ROOT),
    }
    os.environ.update({k: env[k] for k in ("PREFECT_HOME", "PREFECT_API_URL", "NEURON_FLOWS_ROOT")})
    procs: list[subprocess.Popen] = []

    def on_signal(signum, frame):
        raise KeyboardInterrupt

    # Both explicitly: a process started in the background inherits SIGINT ignored.
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        server = _start([sys.executable, "-m", "prefect", "server", "start", "--host", host, "--port", str(port)], env)
        procs.insert(0, server)
        _wait_healthy(api, server)
        names = asyncio.run(register(load_spec()))
        if worker:
            procs.insert(
                0,
                _start(
                    [sys.executable, "-m", "prefect", "worker", "start", "--pool", "local", "--type", "process"], env
                ),
            )
        print(f"Prefect UI: http://{host}:{port}/", flush=True)
        print(f"deployments: {', '.join(names)}", flush=True)
        print(
            "worker: " + ("pool 'local'" if worker else "none") + "; Ctrl-C stops everything started here", flush=True
        )
        while all(p.poll() is None for p in procs):
            time.sleep(1)
        dead = next(p for p in procs if p.poll() is not None)
        print(f"error: {' '.join(dead.args[2:5])} exited with code {dead.returncode}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        _stop(procs)
        print("stopped", flush=True)


def register_only() -> int:
    names = asyncio.run(register(load_spec()))
    print(f"deployments: {', '.join(names)}")
    return 0
