"""`prefect deploy` reads deployments/prefect.yaml as Prefect documents the file: with the work pools
made first (`prefect work-pool create`, from the file's own `work_pools` key), `prefect --no-prompt
deploy --all --prefect-file deployments/prefect.yaml`, run from the repository root against a local
server, creates both deployments without asking anything, and a plain Prefect process worker,
started elsewhere, runs finetune/local to completion."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest
import yaml

from ..conftest import ROOT
from .service_helpers import TERMINAL, small

DEPLOYMENTS = ROOT / "deployments" / "prefect.yaml"
PREFECT = [sys.executable, "-m", "prefect", "--no-prompt"]


def _prefect(args: list[str], env: dict) -> str:
    out = subprocess.run(PREFECT + args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, f"prefect {' '.join(args)} exited {out.returncode}:\n{out.stdout}\n{out.stderr}"
    return out.stdout


def _deploy(env: dict) -> None:
    """What the README's Kubernetes and service sections tell a user to run."""
    for pool in yaml.safe_load(DEPLOYMENTS.read_text())["work_pools"]:
        args = ["work-pool", "create", pool["name"], "--type", pool["type"], "--overwrite"]
        if "base_job_template" in pool:
            args += ["--base-job-template", str(DEPLOYMENTS.parent / pool["base_job_template"])]
        _prefect(args, env)
    out = _prefect(["deploy", "--all", "--prefect-file", "deployments/prefect.yaml"], env)
    assert "Deployment 'finetune/local' successfully created" in out, out
    assert "Deployment 'finetune/trn2' successfully created" in out, out


def _check_deployments(client):
    """The deployments as the file describes them; returns finetune/local."""
    local = client.read_deployment_by_name("finetune/local")
    trn2 = client.read_deployment_by_name("finetune/trn2")
    assert local.work_pool_name == "local" and trn2.work_pool_name == "trn2"
    assert local.entrypoint == trn2.entrypoint == "flows/finetune.py:finetune"
    # {{ $NEURON_FLOWS_ROOT }} filled in by `prefect deploy` from its environment.
    assert local.pull_steps == [{"prefect.deployments.steps.set_working_directory": {"directory": str(ROOT)}}]
    assert trn2.pull_steps[0]["prefect.deployments.steps.set_working_directory"]["directory"] == "/opt/neuron-flows"
    assert trn2.job_variables == {"nnodes": 2, "logical_nc_config": "2"}
    assert local.parameters["config"]["train"]["max_steps"] == 40 and local.enforce_parameter_schema
    schema = local.parameter_openapi_schema
    assert schema["definitions"]["TrainSection"]["properties"]["max_steps"]["default"] == 100
    (cron,) = trn2.schedules
    assert cron.schedule.cron == "0 2 * * *" and cron.schedule.timezone == "UTC" and cron.active is False
    pools = {name: client.read_work_pool(name) for name in ("local", "trn2")}
    assert pools["local"].type == "process" and pools["trn2"].type == "kubernetes"
    assert pools["trn2"].base_job_template["job_configuration"]["job_manifest"]["spec"]["completionMode"] == "Indexed"
    return local


def _wait(client, run_id, timeout: float = 420):
    deadline = time.monotonic() + timeout
    while (run := client.read_flow_run(run_id)).state.type.value not in TERMINAL:
        assert time.monotonic() < deadline, f"flow run still {run.state.name} after {timeout:.0f} s"
        time.sleep(1)
    return run


@pytest.mark.slow
def test_prefect_deploy_creates_the_deployments_and_a_worker_completes_a_run(prefect_server, repo_tiny, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL

    from neuron_parallel.procs import kill_tree

    env = {
        **os.environ,
        "PREFECT_API_URL": PREFECT_API_URL.value(),
        "PREFECT_HOME": str(tmp_path / "prefect-home"),
        "NEURON_FLOWS_ROOT": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "PREFECT_WORKER_QUERY_SECONDS": "2",
        "COLUMNS": "200",  # Prefect's messages on one line each
    }
    t0 = time.monotonic()
    _deploy(env)
    t_deploy = time.monotonic() - t0
    worker_log = (tmp_path / "worker.log").open("w")
    # The worker starts outside the repository: the deployment's pull step is what puts the run there.
    worker = subprocess.Popen(
        PREFECT + ["worker", "start", "--pool", "local", "--type", "process"],
        cwd=tmp_path,
        env=env,
        stdout=worker_log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    run_dir = None
    try:
        with get_client(sync_client=True) as client:
            local = _check_deployments(client)
            run = client.create_flow_run_from_deployment(local.id, parameters={"config": small()})
            run_dir = ROOT / ".runs" / run.name
            t1 = time.monotonic()
            done = _wait(client, run.id)
        print(f"PREFECT-DEPLOY: pools + deployments {t_deploy:.1f} s, run {time.monotonic() - t1:.1f} s")
        assert done.state.type.value == "COMPLETED", (done.state, (tmp_path / "worker.log").read_text()[-3000:])
        assert (run_dir / "checkpoint-8" / "COMPLETE").exists()
        assert (run_dir / "consolidated" / "model.safetensors").stat().st_size > 1_000_000
    finally:
        kill_tree(worker)
        worker_log.close()
        if run_dir is not None:
            shutil.rmtree(run_dir, ignore_errors=True)
