"""Faults injected into a running `neuron-flows serve`, each for real: the worker and its flow-run
process SIGKILLed mid-training, the Hub dropping the connection mid-commit, the Prefect server
SIGKILLed mid-training. Each test prints one line starting with ``FAULT`` with what the fault
cost (steps lost, seconds to detect, orphan processes, data lost, commits) and asserts it.

One service for the module; the server-restart test runs last and stops it, to count what
outlives the service. The three service faults run in the slow tier (CI runs it); the fast tier
keeps the commit whose answer is lost, and the service's own retry and cancel tests
(``test_service.py``).
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import signal
import time
import urllib.request
from pathlib import Path

import pytest

from .service_helpers import (
    TERMINAL,
    alive,
    metric_steps,
    run_dir,
    run_processes,
    service_processes,
    small,
)


def _wait_for(predicate, timeout: float, what: str, svc=None, poll: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(poll)
    tail = "\n".join(svc.lines[-40:]) if svc else ""
    raise AssertionError(f"{what} did not happen within {timeout:.0f} s\n{tail}")


def _only(procs: list[tuple[int, str]], needle: str) -> int:
    pids = [pid for pid, cmd in procs if needle in cmd]
    assert len(pids) == 1, (needle, procs)
    return pids[0]


def _retry(svc, run_id: str) -> dict:
    """The UI's Retry button, then wait for the rerun to end."""
    r = svc.http.post(
        f"/flow_runs/{run_id}/set_state",
        json={"state": {"type": "SCHEDULED", "name": "AwaitingRetry"}, "force": True},
    )
    assert r.status_code in (200, 201), r.text
    return _wait_for(
        lambda: (run := svc.flow_run(run_id))["run_count"] >= 2 and run["state"]["type"] in TERMINAL and run,
        420,
        "the retried run's end",
        svc,
        poll=1,
    )


@pytest.mark.slow
def test_worker_killed_mid_run_is_marked_crashed_and_retry_resumes_from_the_checkpoint(service):
    """SIGKILL the worker and the run's flow-run process after the step-4 checkpoint. torchrun and
    the ranks end with the flow-run process; serve sees the worker die, marks the run Crashed and
    starts a new worker; Retry resumes training from step 4, and every step is recorded once."""
    run = service.run_deployment("local", small(max_steps=8, save_every=4))
    out = run_dir(service, run)
    _wait_for(
        lambda: (out / "checkpoint-4" / "COMPLETE").exists() and max(metric_steps(out), default=0) >= 5,
        300,
        "the step-4 checkpoint",
        service,
        poll=0.1,
    )
    procs = run_processes(service, run["id"])  # the flow-run process, torchrun, two ranks
    engine = _only(procs, "prefect.engine")
    worker = _only(service_processes(service), "prefect worker start")
    os.kill(worker, signal.SIGKILL)
    os.kill(engine, signal.SIGKILL)
    t0 = time.monotonic()
    _wait_for(lambda: not any(alive(pid) for pid, _ in procs), 30, "the end of the run's processes", poll=0.05)
    gone_s = time.monotonic() - t0
    crashed = _wait_for(
        lambda: (r := service.flow_run(run["id"]))["state"]["type"] in TERMINAL and r, 120, "Crashed", service
    )
    detect_s = time.monotonic() - t0
    assert crashed["state"]["type"] == "CRASHED", crashed["state"]
    orphans = [(pid, cmd) for pid, cmd in procs if alive(pid)]
    killed_at = max(metric_steps(out))

    retried = _retry(service, run["id"])
    assert retried["state"]["type"] == "COMPLETED", retried["state"]
    logs = service.logs(run["id"])
    resumed = [int(m.group(1)) for line in logs if (m := re.search(r"resumed from step (\d+)", line))]
    steps = metric_steps(out)
    print(
        f"FAULT worker-killed: steps lost {killed_at - resumed[-1]} (killed at step {killed_at}, resumed from "
        f"{resumed[-1]}); {detect_s:.1f} s to detect (Crashed); {len(orphans)} orphan processes ({len(procs)} "
        f"of the run, all gone {gone_s:.1f} s after the kill); data lost {8 - len(set(steps))} of 8 step records, "
        f"{len(steps) - len(set(steps))} duplicated"
    )
    assert resumed == [4], resumed  # the newest complete checkpoint, not step 0
    assert detect_s < 20 and gone_s < 10, (detect_s, gone_s)
    assert not orphans, orphans
    assert steps == list(range(1, 9)), steps
    assert (out / "consolidated" / "model.safetensors").exists()


@pytest.mark.slow
def test_upload_cut_mid_commit_is_retried_into_exactly_one_commit(service, tmp_path):
    """The Hub drops the connection halfway through the commit request. The upload retries and
    commits the model, the consolidated directory stays (the failed attempt does not roll the
    consolidate+upload transaction back); the repo then holds exactly the consolidated files, in
    one commit, and uploading the same directory again makes no commit."""
    from huggingface_hub import HfApi, snapshot_download
    from prefect.blocks.system import Secret
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from neuron_parallel.checkpoint.output import OWNER_FILE
    from neuron_parallel.hub import upload_model

    from ..conftest import HUB_PORT
    from ..hub_server import LocalHub

    token, repo = "hf_" + secrets.token_hex(20), "alice/tiny-faults"
    with LocalHub(tmp_path / "hub", users={token: "alice"}, port=HUB_PORT) as hub:
        with temporary_settings({PREFECT_API_URL: service.api}):
            Secret(value=token).save("hf-token-faults", overwrite=True)
        hub.fail_next_commit()
        hub_cfg = {"repo_id": repo, "endpoint": hub.url, "token_secret": "hf-token-faults"}
        run = service.run_deployment("local", {**small(max_steps=2, save_every=2), "hub": hub_cfg})
        out = run_dir(service, run)
        final = service.wait(run["id"])
        assert final["state"]["type"] == "COMPLETED", (final["state"], service.logs(run["id"])[-30:])
        upload = service.task_runs(run["id"])["upload"]
        retried = [line for line in service.logs(run["id"]) if line.startswith("upload attempt ")]
        api = HfApi(endpoint=hub.url, token=token)
        commits = api.list_repo_commits(repo)
        model = out / "consolidated"
        local = _digests(model)
        local.pop(OWNER_FILE)  # the output marker, never uploaded
        remote = _digests(Path(snapshot_download(repo, endpoint=hub.url, token=token, cache_dir=tmp_path / "dl")))
        remote.pop(".gitattributes")  # the repo's initial commit
        lost = sorted(path for path in local if remote.get(path) != local[path])
        again = upload_model(model, repo_id=repo, endpoint=hub.url, token=token)
        after = api.list_repo_commits(repo)
    print(
        f"FAULT upload-cut: {hub.dropped_commits} commit cut mid-request; {len(retried) + 1} upload attempts in "
        f"{upload['run_count']} task run; commits {len(commits) - 1} (+ the repo's initial one); data lost "
        f"{len(lost)} of {len(local)} files; identical re-upload made {len(after) - len(commits)} commits"
    )
    assert hub.dropped_commits == 1 and len(retried) == 1 and upload["state"]["type"] == "COMPLETED", retried
    assert (out / "consolidated" / "model.safetensors").exists()  # not rolled back by the failed attempt
    assert len(commits) == 2 and commits[-1].title == "initial commit", [c.title for c in commits]
    assert not lost and set(remote) == set(local), (lost, sorted(remote), sorted(local))
    assert len(after) == len(commits) and again.revision == commits[0].commit_id


def test_commit_made_but_its_answer_lost_is_not_made_twice(tmp_path):
    """The Hub commits and then drops the connection, so the client sees a failure although the
    commit happened. upload_model's retry finds every file on the Hub and makes no second commit;
    nor does uploading the same files again."""
    import torch
    from huggingface_hub import HfApi
    from safetensors.torch import save_file

    from neuron_parallel.hub import upload_model

    from ..hub_server import LocalHub

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    save_file({"w": torch.ones(64, 64)}, str(model / "model.safetensors"))
    failures: list[str] = []
    with LocalHub(tmp_path / "hub") as hub:
        repo = f"{hub.user}/m"
        hub.fail_next_commit(committed=True)
        first = upload_model(
            model,
            repo_id=repo,
            endpoint=hub.url,
            token=hub.token,
            retries=1,
            retry_delay_s=0,
            on_retry=lambda attempt, err: failures.append(type(err).__name__),
        )
        again = upload_model(model, repo_id=repo, endpoint=hub.url, token=hub.token)
        commits = HfApi(endpoint=hub.url).list_repo_commits(repo)
    print(
        f"FAULT commit-answer-lost: {hub.dropped_commits} commit made but its answer dropped; "
        f"{len(failures) + 1} upload attempts; commits {len(commits) - 1} (+ the repo's initial one); "
        f"identical re-upload made {int(again.revision != first.revision)} commits"
    )
    assert hub.dropped_commits == 1 and len(failures) == 1, failures
    assert len(commits) == 2 and commits[0].commit_id == first.revision == again.revision, commits


@pytest.mark.slow
def test_server_killed_mid_run_is_restarted_and_the_run_finishes_once(service):
    """SIGKILL the Prefect server while the run trains. serve starts it again on the same port
    and database; the run's API calls wait for it, the run completes on its first attempt, each
    step is trained once, and after the service stops none of its processes is left."""
    run = service.run_deployment("local", small(max_steps=8, save_every=8))
    out = run_dir(service, run)
    _wait_for(lambda: max(metric_steps(out), default=0) >= 2, 300, "step 2", service, poll=0.1)
    server = _only(service_processes(service), "prefect server start")
    before = len(service.lines)
    os.killpg(server, signal.SIGKILL)
    t0 = time.monotonic()
    step_at_kill = max(metric_steps(out))
    _wait_for(lambda: "server started again" in service.lines[before:], 240, "the server's restart", service)
    down_s = time.monotonic() - t0
    with urllib.request.urlopen(f"{service.api}/health", timeout=10) as r:
        assert r.status == 200
    final = service.wait(run["id"])
    # The flow-run process sends its last logs as it exits, after its final state.
    _wait_for(lambda: not run_processes(service, run["id"]), 60, "the flow-run process's exit", service)
    steps = metric_steps(out)
    logs = service.logs(run["id"])
    logged = {int(m.group(1)) for line in logs if (m := re.match(r"step (\d+)/8 ", line))}
    train = service.task_runs(run["id"])["train"]
    servers = [pid for pid, cmd in service_processes(service) if "prefect server start" in cmd]

    code = service.stop()
    orphans = service_processes(service)
    print(
        f"FAULT server-killed: killed at step {step_at_kill}, API back after {down_s:.1f} s; steps lost "
        f"{len(set(range(1, 9)) - set(steps))}, {len(steps) - len(set(steps))} trained twice (run attempts "
        f"{final['run_count']}, train attempts {train['run_count']}); data lost {8 - len(logged)} of 8 step log lines; "
        f"{len(orphans)} orphan processes after the service stopped"
    )
    assert final["state"]["type"] == "COMPLETED", final["state"]
    assert final["run_count"] == 1 and train["run_count"] == 1, (final["run_count"], train)
    assert not any("resumed from step" in line for line in logs)
    assert steps == list(range(1, 9)), steps
    assert logged == set(range(1, 9)), sorted(logged)
    assert servers != [server] and len(servers) == 1, servers
    assert code == 0 and not orphans, orphans


def _digests(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root``, by path relative to it."""
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }
