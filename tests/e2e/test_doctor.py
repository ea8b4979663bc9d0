"""`neuron-flows doctor`, the installed command: on this CPU host with two ranks every check passes
and stdout is only the JSON report; a device the host lacks, or bad input, exits 2 within seconds
with one line naming the fix and no traceback, and leaves nothing behind."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

CLI = Path(sys.executable).parent / "neuron-flows"
REFUSED_WITHIN_S = 60


def test_cpu_with_two_ranks_passes_every_check(tmp_path):
    proc = subprocess.run(
        [str(CLI), "doctor", "--device", "cpu", "--nproc", "2", "--json"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    checks = json.loads(proc.stdout)["checks"]  # nothing but the JSON on stdout
    assert all(set(c) == {"name", "ok", "detail", "seconds"} for c in checks)
    assert [c["name"] for c in checks if not c["ok"]] == []
    assert len(checks) >= 5 and len({c["name"] for c in checks}) == len(checks)
    names = [c["name"] for c in checks]
    (parity,) = [c for c in checks if "parity smoke" in c["name"]]
    assert "dp=2" in parity["detail"] and "of one CPU process" in parity["detail"]
    for part in ("stack:", "one rank:", "all ranks:"):
        assert any(n.startswith(part) for n in names), (part, names)
    for axis in ("dp", "tp", "pp"):
        assert any(f"collectives on the {axis} groups" in n for n in names), axis
    assert any("batch_isend_irecv" in n for n in names) and any("object collectives" in n for n in names)
    sdpa = next(c for c in checks if "scaled_dot_product_attention" in c["name"])
    assert "ran aten::" in sdpa["detail"]  # the kernel the dispatcher chose is named
    # The parity smoke trained both runs in the doctor's work directory, 3 steps each.
    for run in ("parity-device", "parity-cpu"):
        rows = (tmp_path / ".runs" / "doctor" / run / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(r)["step"] for r in rows] == [1, 2, 3]


@pytest.mark.parametrize(
    "args, says",
    [
        (["--device", "cuda"], "no CUDA device"),
        (["--device", "neuron"], "torch-neuronx"),
        (["--device", "cpu", "--nproc", "0"], "launch.nproc_per_node"),
        (["--config", "missing.yaml"], "missing.yaml does not exist"),
    ],
    ids=["cuda", "neuron", "nproc-0", "no-config-file"],
)
def test_absent_device_or_bad_input_exits_2_at_once(tmp_path, args, says):
    t0 = time.monotonic()
    proc = subprocess.run(
        [str(CLI), "doctor", *args, "--json"], capture_output=True, text=True, cwd=tmp_path, timeout=120
    )
    elapsed = time.monotonic() - t0
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("error: ") and says in line, line
    assert elapsed < REFUSED_WITHIN_S, elapsed
    assert list(tmp_path.iterdir()) == []  # nothing was written


@pytest.mark.slow
def test_a_failed_check_exits_1_and_says_which(tmp_path):
    """The parity smoke may not write into a folder neuron-flows did not create: that check fails,
    the others pass, the table says so and the folder is left as it was."""
    foreign = tmp_path / "work" / "parity-device"
    foreign.mkdir(parents=True)
    (foreign / "notes.txt").write_text("mine")
    proc = subprocess.run(
        [str(CLI), "doctor", "--nproc", "2", "--work-dir", str(tmp_path / "work")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=400,
    )
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    (failed,) = [line for line in lines if line.startswith("FAIL")]
    assert "parity smoke" in failed and "neuron-flows did not write" in failed, failed
    assert lines[-1].endswith(", 1 failed") and sum(line.startswith("ok ") for line in lines) >= 5
    assert [p.name for p in foreign.iterdir()] == ["notes.txt"] and (foreign / "notes.txt").read_text() == "mine"
