"""Communication of the training step: the gradient reduction, clipping and ZeRO-1 update issue a
number of collectives that does not grow with the number of parameters, the dp reduction starts
during backward (``dist_comm_check.py``, 4 ranks), and a whole
step moves at most 1.10x the bytes its layout must (``comm_audit.minimum_bytes``), by the audit
``bench/comm.py`` runs (``neuron_parallel.testing.comm_audit`` as a module on every rank)."""

from __future__ import annotations

from pathlib import Path

import pytest

from neuron_parallel.testing import comm_audit
from neuron_parallel.testing.ranks import run_ranks

from ..conftest import write_job

CHECK = Path(__file__).with_name("dist_comm_check.py")
MAX_COLLECTIVES = 8
"""dp2 × tp2 + SP + ZeRO-1, one gradient bucket: the bucket's all-reduce, the tp all-reduce of the
norms' partial grads, the norm's scalar all-reduce over tp, one broadcast per dp rank; room for
a few more, far below one per parameter (27 and 63 parameters per rank here)."""


def test_reduction_collectives_do_not_grow_with_parameters(tmp_path):
    r = run_ranks(CHECK, 4, [str(tmp_path)], timeout=180)
    assert r.returncode == 0, r.tail()
    assert sorted(x["rank"] for x in r.results) == [0, 1, 2, 3]
    for res in r.results:
        small, large = res["depths"]["2"], res["depths"]["6"]
        assert large["num_params"] > 2 * small["num_params"], res
        assert small["collectives"] == large["collectives"] <= MAX_COLLECTIVES, res
        assert small["kinds"] == large["kinds"], res
        ov = res["overlap"]
        assert ov["buckets"] >= 4 and ov["dp_during_backward"] == ov["buckets"], ov
        assert ov["started_before_backward_ended"], ov


@pytest.mark.slow
@pytest.mark.parametrize("name", list(comm_audit.LAYOUTS))
def test_step_moves_at_most_110_percent_of_the_layout_minimum(name, tiny_world, tiny_dataset, tmp_path):
    world, parallel = comm_audit.LAYOUTS[name]
    job = write_job(tmp_path, tiny_world["model"], tiny_dataset.path, world=world, parallel=parallel)
    r = run_ranks(comm_audit.RANK_MODULE, world, [str(job)], timeout=300)
    assert r.returncode == 0, r.tail()
    assert len(r.results) == world
    for res in r.results:
        rows = [row for row in res["rows"] if not row["scalar"]]
        assert rows, res
        for row in rows:  # no traffic of a kind the layout does not need, none above 1.10x what it needs
            assert row["bytes"] <= comm_audit.GOAL * row["minimum_bytes"], (res["rank"], row)
            assert row["bytes"] >= row["minimum_bytes"], (res["rank"], row)  # else the model of the minimum is wrong
        phases = [p for row in res["rows"] for p, n in row.get("phases", {}).items() for _ in range(n)]
        assert sum(p in ("reduce_and_clip", "optimizer_step") for p in phases) <= 8, res
