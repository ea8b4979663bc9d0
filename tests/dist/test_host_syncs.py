"""A plain optimizer step (one that does not log, evaluate or checkpoint) converts no tensor to a
Python value on any rank, and builds no DeviceMesh, at dp2 (ZeRO-1), tp2 with sequence
parallelism, pp2 (1F1B, 2 microbatches) and cp2 (rows cut on the host): counted from outside the trainer by
``dist_host_syncs.py``, which wraps every ``Tensor.item``/``tolist``/``numpy``/``__int__``/
``__float__``/``__bool__``/``__index__`` and ``DeviceMesh.__init__`` before the jobs start and
counts the calls whose stack passes through neuron_parallel code (torch's own host-side optimizer
step counters and a DeviceMesh's rank tables left out; the checkpoint writer's thread reported
apart). One torchrun trains all eight jobs, a run of 6 and one of 12 steps per layout, each logging
and checkpointing once (at its last step): both runs of a layout must make exactly the same
number of conversions, none of them in steps ``1 .. max_steps - 1``, but for what pp2's schedule
forces.

What pp2 costs: torch.distributed.pipelining sets a schedule up at its first ``step``: a warm-up
vote between the stages, read with ``.item()``, and one ``recv_object_list`` of the neighbouring
stage's tensor metadata (its size read with ``.item()``, the bytes with ``numpy()``, a slice
bound with ``__index__``): 5 conversions on each rank in the first step of every (re)started run,
none after it. The counts at the last step and outside the steps (setup, checkpoint) are the same
in both runs; the step that logs converts the window's losses and gradient norms in one read.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from neuron_parallel.testing.ranks import run_ranks

from ..conftest import ROOT, read_metrics, write_job

SCRIPT = Path(__file__).with_name("dist_host_syncs.py")
LAYOUTS = {
    "dp2": dict(zero_1=True),
    "tp2-sp": dict(tp=2, sequence_parallel=True),
    "pp2": dict(pp=2, num_microbatches=2),
    "cp2": dict(cp=2),
}
RUNS = (6, 12)
GLOBAL_BATCH = 8

pytestmark = pytest.mark.timeout(900)


PIPELINE_SETUP = "neuron_parallel/parallel/pipeline.py"
"""Where pp2's first-step conversions come from: the schedule's ``step``, inside torch."""


def _plain(counts: dict[str, int], max_steps: int, first: int = 1) -> dict[str, int]:
    """The counts of the plain steps from ``first`` on (every step but the last, which logs and
    checkpoints)."""
    return {p: n for p, n in counts.items() if p.isdigit() and first <= int(p) < max_steps and n}


def test_plain_steps_convert_no_tensor_to_python(tiny_world, tiny_dataset, tmp_path):
    jobs = []
    for name, parallel in LAYOUTS.items():
        dp = 2 // parallel.get("tp", 1) // parallel.get("pp", 1) // parallel.get("cp", 1)
        for steps in RUNS:
            train = dict(
                max_steps=steps, log_every=steps, save_every=steps, micro_batch_size=GLOBAL_BATCH // dp, lr=1e-3
            )
            run = tmp_path / f"{name}-{steps}"
            path = write_job(run, tiny_world["model"], tiny_dataset.path, world=2, parallel=parallel, train=train)
            jobs.append({"name": f"{name}-{steps}", "job": str(path)})
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    result = run_ranks(SCRIPT, 2, [str(tmp_path / "jobs.json")], cwd=ROOT, timeout=840)
    assert result.returncode == 0, result.tail()
    got = {(r["rank"], r["name"]): r for r in result.results}
    summary = []
    for name in LAYOUTS:
        for rank in (0, 1):
            short, long = got[rank, f"{name}-{RUNS[0]}"], got[rank, f"{name}-{RUNS[1]}"]
            totals = [sum(r["conversions"].values()) for r in (short, long)]
            summary.append(f"{name} rank {rank}: {totals[0]} / {totals[1]} conversions ({short['conversions']})")
            for steps, report in zip(RUNS, (short, long)):
                counts, where = report["conversions"], (name, rank, steps)
                sites = {k: v for k, v in report["sites"].items() if k.split()[0] not in ("setup", "end", str(steps))}
                first = 2 if name == "pp2" else 1
                assert not _plain(counts, steps, first), (where, counts, sites)
                assert not _plain(report["meshes"], steps), (where, report["meshes"])
                if first == 2:
                    assert all(PIPELINE_SETUP in k for k in sites), (where, sites)
            assert totals[0] == totals[1], (name, rank, short["conversions"], long["conversions"])
    print("\n".join(summary))
    for entry in jobs:  # every step's row is written, with its own time
        rows = read_metrics(Path(entry["job"]).parent)
        steps = int(entry["name"].rsplit("-", 1)[1])
        assert [r["step"] for r in rows] == list(range(1, steps + 1)), entry["name"]
        assert all(r["step_time_s"] > 0 and r["grad_norm"] > 0 for r in rows), rows
