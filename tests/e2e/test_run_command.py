"""`neuron-flows run` as a user runs it: the installed command, no PREFECT_API_URL, so it starts
Prefect's temporary server itself (its own PREFECT_HOME here). The command exits as soon as it has
printed its summary, and the server's database holds the whole run: the flow run and every task run
Completed, every log line the run printed and its artifacts. A run refused by the preflight stops
the server it had started."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ..conftest import ROOT

CLI = Path(sys.executable).parent / "neuron-flows"
STEPS = ("preflight", "tokenize", "plan", "train", "validate", "consolidate", "evaluate", "upload", "report")
EXIT_BOUND_S = 2.0
"""Seconds from the summary's last line to the process's exit (interpreter shutdown alone, with
torch, transformers and Prefect loaded, takes seconds on a busy machine; a queued log or event
for a stopped server would hold the process for a minute)."""


def _run(tiny_world, tmp_path: Path, *sets: str) -> tuple[int, list[tuple[float, str]], float]:
    """The installed command with its own PREFECT_HOME; its lines with their arrival times and
    the time it exited, in seconds since it started."""
    cmd = [str(CLI), "run", str(ROOT / "configs" / "tiny-llama-cpu.yaml")]
    for kv in (
        f"model.name_or_path={tiny_world['model']}",
        f"data.source={tiny_world['corpus']}",
        f"data.cache_dir={tmp_path / 'datasets'}",
        "data.block_size=32",
        "train.max_steps=2",
        f"output.dir={tmp_path / 'run'}",
        *sets,
    ):
        cmd += ["--set", kv]
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(OMP_NUM_THREADS="1", PREFECT_HOME=str(tmp_path / "prefect"))
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    lines = [(time.monotonic() - t0, line.rstrip("\n")) for line in proc.stdout]
    code = proc.wait(timeout=60)
    return code, lines, time.monotonic() - t0


def _left_behind(prefect_home: Path) -> list[int]:
    """Processes still running with this PREFECT_HOME in their environment (a server left over)."""
    marker = f"PREFECT_HOME={prefect_home}".encode() + b"\0"
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if marker in Path(f"/proc/{entry.name}/environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


@pytest.mark.slow
def test_run_exits_after_its_summary_with_the_run_recorded(tiny_world, tmp_path):
    code, lines, exited = _run(tiny_world, tmp_path)
    text = "\n".join(line for _, line in lines)
    assert code == 0, text[-4000:]
    assert (
        lines[-2][1] == f"run: {tmp_path / 'run'}" and lines[-1][1] == f"consolidated: {tmp_path / 'run/consolidated'}"
    )
    assert exited - lines[-1][0] < EXIT_BOUND_S, f"exited {exited - lines[-1][0]:.1f} s after its last line"
    starting = next(i for i, (_, x) in enumerate(lines) if "Starting temporary server" in x)
    assert starting < next(i for i, (_, x) in enumerate(lines) if "Beginning flow run" in x)
    assert "Error logging to API" not in text and "Traceback" not in text, text[-4000:]
    assert not _left_behind(tmp_path / "prefect")

    run_logs = [x for _, x in lines if " | Flow run '" in x or " | Task run '" in x]
    name = next(x for x in run_logs if "Beginning flow run" in x).split("Flow run '")[1].split("'")[0]
    db = sqlite3.connect(tmp_path / "prefect" / "prefect.db")
    try:
        flow_run_id, state = db.execute("select id, state_name from flow_run where name = ?", (name,)).fetchone()
        tasks = dict(db.execute("select name, state_name from task_run where flow_run_id = ?", (flow_run_id,)))
        logs = db.execute("select count(*) from log where flow_run_id = ?", (flow_run_id,)).fetchone()[0]
        keys = {k for (k,) in db.execute("select key from artifact where flow_run_id = ?", (flow_run_id,))}
    finally:
        db.close()
    assert state == "Completed"
    assert {n.rsplit("-", 1)[0]: s for n, s in tasks.items()} == dict.fromkeys(STEPS, "Completed")
    assert logs == len(run_logs), f"{logs} logs recorded, {len(run_logs)} printed"
    assert {"data-audit", "plan", "train-progress", "summary"} <= keys


def test_a_run_refused_by_the_preflight_stops_its_server(tiny_world, tmp_path):
    """The temporary server starts while the preflight runs; a refusal stops it before exit 2."""
    code, lines, _ = _run(tiny_world, tmp_path, "launch.device=cuda")
    text = "\n".join(line for _, line in lines)
    assert code == 2, text[-4000:]
    assert lines[-1][1].startswith("error: launch.device=cuda but this machine has no CUDA device"), text[-4000:]
    assert "Traceback" not in text
    assert not _left_behind(tmp_path / "prefect")
    assert not (tmp_path / "run").exists() and not (tmp_path / "datasets").exists()
