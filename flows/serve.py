"""``neuron-flows serve``: a local Prefect server, the work pools and deployments of
``deployments/prefect.yaml``, and a worker for the ``local`` pool, in one command.

    neuron-flows serve [--host 127.0.0.1] [--port 4200] [--home .runs/prefect]

The server keeps its SQLite database under ``--home``, listens on loopback only (Prefect's API
has no authentication), and has telemetry off. Everything started here runs in its own process
group and is stopped by Ctrl-C or SIGTERM, children first. ``--register-only`` registers pools
and deployments on the server at ``PREFECT_API_URL`` and exits.

Registration is Prefect's: the pools of the file's ``work_pools`` key are created (``prefect
deploy`` creates none without asking), then ``prefect deploy --all --prefect-file
deployments/prefect.yaml`` runs from the repository root. With ``NEURON_FLOWS_NOTIFY_WEBHOOK``
set, a Prefect automation posts to that webhook when a run of these deployments fails or crashes
(flows/notify.py); without it, an automation an earlier registration made is removed.

What serve does when a part of the service dies (at most ``MAX_RESTARTS`` times per part within
``RESTART_WINDOW_S``, then it stops everything and exits 1):

* The server exits: started again on the same port and database. Flow runs keep going meanwhile;
  their API calls wait and retry (``PREFECT_CLIENT_MAX_RETRIES`` below) until it answers again.
* The worker exits: before a new worker starts, the runs of the ``local`` pool that are Pending or
  Running with no flow-run process left are marked Crashed (Retry in the UI resumes them from
  their last checkpoint), and what those processes started (torchrun, ranks) is ended.
* A flow-run process dies, worker alive: the worker marks the run Crashed; serve ends what the
  process left behind, found by the run id every process of a run carries (``PREFECT__FLOW_RUN_ID``).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import deque
from pathlib import Path

import yaml

from neuron_flows.flows.notify import WEBHOOK_ENV
from neuron_parallel.procs import die_with_parent, end_processes, kill_tree, processes, signal_group, start_time

ROOT = Path(__file__).resolve().parents[1]
DEPLOYMENTS = ROOT / "deployments" / "prefect.yaml"
POOL = "local"
"""The work pool the worker started here serves."""
MAX_RESTARTS = 3
RESTART_WINDOW_S = 600.0
SERVE_ID_ENV = "NEURON_FLOWS_SERVE_ID"
"""Set in everything serve starts, inherited down to the ranks: what serve ends when it stops."""
RUN_ID_ENV = "PREFECT__FLOW_RUN_ID"
"""Set by the worker in a flow-run process, inherited by torchrun and the ranks."""
_SWEEP_EVERY_S = 2.0


def load_spec(path: Path = DEPLOYMENTS) -> dict:
    """``deployments/prefect.yaml`` as written; ``prefect deploy`` fills in its placeholders."""
    return yaml.safe_load(path.read_text())


async def create_work_pools(spec: dict, base: Path = DEPLOYMENTS.parent) -> None:
    """Create or update the work pools of the spec's ``work_pools`` key. The key is this project's:
    ``prefect deploy`` reads no pool definitions and creates a missing pool only when it can ask,
    so the pools are made first, as ``prefect work-pool create --overwrite`` would."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.workers.process import ProcessWorker

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


def prefect_deploy(prefect_file: Path = DEPLOYMENTS) -> str:
    """``prefect --no-prompt deploy --all --prefect-file FILE`` from the repository root, against the
    current Prefect settings' API. Prefect's own command, not a reading of the file here: its
    deploy code is private to its command line (``prefect.cli.deploy``), and this way the file
    means exactly what it means to a user who runs the command (validation, ``{{ $NAME }}``
    placeholders, pull steps, schedules, parameter schema). ``NEURON_FLOWS_ROOT`` defaults to this
    repository's root. Returns the last lines the command printed."""
    from prefect.settings import get_current_settings

    env = {
        "NEURON_FLOWS_ROOT": str(ROOT),
        **os.environ,
        **get_current_settings().to_environment_variables(exclude_unset=True),
        "COLUMNS": "200",  # its messages unwrapped, should they be shown below
    }
    cmd = [sys.executable, "-m", "prefect", "--no-prompt", "deploy", "--all", "--prefect-file", str(prefect_file)]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    tail = "\n".join((out.stdout + out.stderr).strip().splitlines()[-30:])
    if out.returncode != 0:  # a file Prefect refuses, or no server: its own words name the problem
        raise ValueError(f"prefect deploy of {prefect_file} failed (exit code {out.returncode}):\n{tail}")
    return tail


async def _deployed_names(spec: dict, said: str) -> list[str]:
    """``flow/deployment`` of each deployment of the spec, read back from the server: what proves
    that ``prefect deploy`` made them (it skips a file it finds invalid, and ``said`` why)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName

    wanted = {(d["name"], d["entrypoint"]) for d in spec["deployments"]}
    async with get_client() as client:
        found = await client.read_deployments(
            deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=sorted({n for n, _ in wanted})))
        )
        names = {
            (d.name, d.entrypoint): f"{(await client.read_flow(d.flow_id)).name}/{d.name}"
            for d in found
            if (d.name, d.entrypoint) in wanted
        }
    if missing := sorted(name for name, _ in wanted - set(names)):
        raise ValueError(f"prefect deploy made no deployment named {', '.join(missing)}; it said:\n{said}")
    return sorted(names.values())


async def register(spec: dict | None = None) -> list[str]:
    """Create or update the work pools, then deploy the deployments with ``prefect deploy``, of
    ``spec`` (default: ``deployments/prefect.yaml`` itself); returns ``flow/deployment`` names."""
    await create_work_pools(load_spec() if spec is None else spec)
    if spec is None:
        return await _deployed_names(load_spec(), prefect_deploy())
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "prefect.yaml")
        path.write_text(yaml.safe_dump({k: v for k, v in spec.items() if k != "work_pools"}, sort_keys=False))
        said = prefect_deploy(path)
    return await _deployed_names(spec, said)


async def _register_all() -> list[str]:
    """Pools, deployments and, when a webhook is set, the failure notifications (flows/notify.py)."""
    from neuron_flows.flows.notify import sync_failure_notifications

    names = await register()
    if await sync_failure_notifications(sorted({n.split("/", 1)[0] for n in names})):
        print(f"failure notifications: on (${WEBHOOK_ENV})", flush=True)
    return names


def wait_healthy(api: str, proc: subprocess.Popen, timeout: float = 240, poll_s: float = 0.5) -> None:
    """Wait until the Prefect server ``proc`` answers ``{api}/health``; raise if it exits first or never answers."""
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
        time.sleep(poll_s)
    raise RuntimeError(f"the Prefect server did not answer at {api}/health within {timeout:.0f} s")


def _start(cmd: list[str], env: dict) -> subprocess.Popen:
    """Start ``cmd`` in a session of its own; it gets SIGTERM when serve dies, even by SIGKILL,
    so no server or worker outlives it."""
    return subprocess.Popen(cmd, env=env, cwd=ROOT, start_new_session=True, preexec_fn=die_with_parent(os.getpid()))


def _stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:  # the worker (and any flow run it started) first, then the server
        kill_tree(proc)


class _Child:
    """The server or the worker: a subprocess that serve starts again when it exits."""

    def __init__(self, name: str, cmd: list[str], env: dict) -> None:
        self.name, self.cmd, self.env = name, cmd, env
        self.proc = _start(cmd, env)
        self.started = start_time(self.proc.pid)  # not reaped yet: /proc has it, even if it exited
        self._restarts: deque[float] = deque()

    def restart(self) -> bool:
        """Start the command again; False, with nothing started, once it has been restarted
        ``MAX_RESTARTS`` times within ``RESTART_WINDOW_S``."""
        now = time.monotonic()
        while self._restarts and now - self._restarts[0] > RESTART_WINDOW_S:
            self._restarts.popleft()
        if len(self._restarts) >= MAX_RESTARTS:
            return False
        self._restarts.append(now)
        signal_group(self.proc.pid, self.started, signal.SIGKILL)  # what the dead one left in its group, if any
        self.proc = _start(self.cmd, self.env)
        self.started = start_time(self.proc.pid)
        return True


def _runs_processes(serve_id: str | None = None) -> dict[str, list[tuple[int, int, str]]]:
    """Live processes of flow runs by run id (the flow-run process, torchrun, the ranks), each as
    (pid, start time, command line); with ``serve_id``, only those started under that serve."""
    runs: dict[str, list[tuple[int, int, str]]] = {}
    for pid, started, cmd, env in processes():
        if RUN_ID_ENV in env and (serve_id is None or env.get(SERVE_ID_ENV) == serve_id):
            runs.setdefault(env[RUN_ID_ENV], []).append((pid, started, cmd))
    return runs


def _has_flow_run_process(procs: list[tuple[int, int, str]]) -> bool:
    """Whether a run's processes include its flow-run process: the Prefect process the worker
    started (``python -m prefect.engine``, first a workspace supervisor that execs into it), as
    opposed to torchrun and the ranks it starts."""
    return any(re.search(r"(^|\s)-m prefect[.\s]|/prefect\s", cmd) for *_, cmd in procs)


def end_orphans(serve_id: str) -> list[int]:
    """End the processes of flow runs whose flow-run process is gone: the torchrun and ranks that a
    killed flow-run process leaves behind, which would otherwise go on writing into the run
    directory a retry resumes from. SIGTERM first (torchrun passes it on to the ranks), SIGKILL
    to what is left 5 s later, each only while its pid still has the start time it was found
    with (``procs.end_processes``). Returns their pids."""
    found = [
        (pid, started)
        for procs in _runs_processes(serve_id).values()
        if not _has_flow_run_process(procs)
        for pid, started, _ in procs
    ]
    end_processes(found)
    return [pid for pid, _ in found]


async def crash_lost_runs(pool: str = POOL) -> list[str]:
    """Mark Crashed the runs of ``pool`` that are Pending or Running although no flow-run process
    of theirs is alive: their worker died with them, so nothing else will. Call it while no worker
    serves the pool (no run can be starting meanwhile). Returns the runs' names."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
        WorkPoolFilter,
        WorkPoolFilterName,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.states import Crashed

    alive = {run_id for run_id, procs in _runs_processes().items() if _has_flow_run_process(procs)}
    async with get_client() as client:
        runs = await client.read_flow_runs(
            flow_run_filter=FlowRunFilter(
                state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.PENDING, StateType.RUNNING]))
            ),
            work_pool_filter=WorkPoolFilter(name=WorkPoolFilterName(any_=[pool])),
        )
        lost = [run for run in runs if str(run.id) not in alive]
        for run in lost:
            message = "its flow-run process is gone (the worker that ran it died); Retry resumes it"
            await client.set_flow_run_state(run.id, Crashed(message=message))
    return [run.name for run in lost]


def _mark_lost_runs() -> None:
    try:
        names = asyncio.run(crash_lost_runs())
    except Exception as err:  # the server may be down too: the runs stay as they are, the worker still starts
        print(f"warning: could not check for runs left without a process: {err}", file=sys.stderr, flush=True)
        return
    if names:
        print(f"marked Crashed, no process left: {', '.join(names)}", flush=True)


def _supervise(children: list[_Child], api: str, serve_id: str) -> int:
    """Until a signal arrives: start the server or the worker again when it exits, and end the
    processes of runs whose flow-run process died. Returns 1 once a child has used up its restarts."""
    last_sweep = time.monotonic()
    while True:
        time.sleep(1)
        for child in reversed(children):  # the server first: the worker's restart needs the API
            code = child.proc.poll()
            if code is None:
                continue
            print(f"{child.name} exited with code {code}", flush=True)
            if child.name == "worker":
                end_orphans(serve_id)
                _mark_lost_runs()
            if not child.restart():
                print(
                    f"error: {child.name} exited {MAX_RESTARTS + 1} times within {RESTART_WINDOW_S:.0f} s",
                    file=sys.stderr,
                )
                return 1
            if child.name == "server":
                try:
                    wait_healthy(api, child.proc)
                except RuntimeError as err:
                    print(f"warning: {err}", file=sys.stderr, flush=True)
                    continue
            print(f"{child.name} started again", flush=True)
        if time.monotonic() - last_sweep >= _SWEEP_EVERY_S:
            last_sweep = time.monotonic()
            if pids := end_orphans(serve_id):
                print(f"ended {len(pids)} processes of runs whose flow-run process died", flush=True)


def serve(host: str, port: int, home: Path, worker: bool = True) -> int:
    if host not in ("127.0.0.1", "localhost", "::1"):
        print(
            f"warning: binding {host}: Prefect's API has no authentication; anyone who can reach it can run "
            "flows and read parameters",
            file=sys.stderr,
        )
    home.mkdir(parents=True, exist_ok=True)
    api = f"http://{host}:{port}/api"
    serve_id = f"{os.getpid()}-{secrets.token_hex(8)}"
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
        # A client retries a refused or dropped API call with backoff 2, 4, 8, ... s: 7 retries
        # outlast a server restart of up to 4 minutes (the default 5, about one minute).
        "PREFECT_CLIENT_MAX_RETRIES": os.environ.get("PREFECT_CLIENT_MAX_RETRIES", "7"),
        "NEURON_FLOWS_ROOT": str(ROOT),
        SERVE_ID_ENV: serve_id,
    }
    if os.environ.get(WEBHOOK_ENV, "").strip():  # the services that run automations and their actions
        env["PREFECT_SERVER_SERVICES_TRIGGERS_ENABLED"] = "true"
    os.environ.update({k: env[k] for k in ("PREFECT_HOME", "PREFECT_API_URL", "NEURON_FLOWS_ROOT")})
    children: list[_Child] = []  # in the order they stop: the worker before the server

    def on_signal(signum, frame):
        raise KeyboardInterrupt

    # Both explicitly: a process started in the background inherits SIGINT ignored.
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        server_cmd = [sys.executable, "-m", "prefect", "server", "start", "--host", host, "--port", str(port)]
        children.append(_Child("server", server_cmd, env))
        wait_healthy(api, children[0].proc)
        names = asyncio.run(_register_all())
        if worker:
            _mark_lost_runs()  # runs a worker of an earlier serve left Running when it was killed
            worker_cmd = [sys.executable, "-m", "prefect", "worker", "start", "--pool", POOL, "--type", "process"]
            children.insert(0, _Child("worker", worker_cmd, env))
        print(f"Prefect UI: http://{host}:{port}/", flush=True)
        print(f"deployments: {', '.join(names)}", flush=True)
        print(
            "worker: " + (f"pool '{POOL}'" if worker else "none") + "; Ctrl-C stops everything started here",
            flush=True,
        )
        return _supervise(children, api, serve_id)
    except KeyboardInterrupt:
        return 0
    finally:
        _stop([child.proc for child in children])
        # Flow runs the worker started are in sessions of their own: end them and what they started.
        end_processes([(pid, started) for pid, started, _, env in processes() if env.get(SERVE_ID_ENV) == serve_id])
        print("stopped", flush=True)


def register_only() -> int:
    names = asyncio.run(_register_all())
    print(f"deployments: {', '.join(names)}")
    return 0
