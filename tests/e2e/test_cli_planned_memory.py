"""`neuron-flows train` on the demo config with an auto layout: the planner's choice runs, and
every rank's measured memory stays within the planner's prediction."""

import json

import pytest


@pytest.mark.slow
def test_planner_chosen_tiny_plan_runs_and_its_memory_holds(tiny_world, tmp_path):
    """The demo config (auto layout) through `neuron-flows train` with train.profile_memory: every
    rank's measured peak tensor memory (neuron_parallel.memprof) is within ±15 % of the planner's
    prediction for that rank, and below the plan's memory per rank plus 15 %."""
    import os
    import subprocess
    import sys

    from ..conftest import ROOT, read_metrics

    run = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "neuron_flows.flows.cli",
            "train",
            str(ROOT / "configs/tiny-llama-cpu.yaml"),
            "--set",
            f"model.name_or_path={tiny_world['model']}",
            "--set",
            f"data.source={tiny_world['corpus']}",
            "--set",
            f"data.cache_dir={tmp_path / 'datasets'}",
            "--set",
            "train.max_steps=3",
            "--set",
            "train.save_every=0",
            "--set",
            "train.profile_memory=true",
            "--set",
            f"output.dir={run}",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=400,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    chosen = next(line for line in proc.stdout.splitlines() if line.startswith("plan: chosen by the planner for cpu"))
    planned_total = float(chosen.rsplit("predicted ", 1)[1].split()[0]) * 2**30
    assert len(read_metrics(run)) == 3
    ranks = json.loads((run / "memory.json").read_text())
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        assert r["measured_bytes"] > 10 * 2**20  # the tiny model's states alone are ~20 MiB: a real measurement
        assert abs(r["predicted_bytes"] / r["measured_bytes"] - 1) <= 0.15, r
        assert r["measured_bytes"] <= 1.15 * planned_total, (r, planned_total)
