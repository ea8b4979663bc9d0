"""Pipeline parallelism, multi-rank parity with one process for every schedule: ``dist_pp_check.py``
under torchrun (gloo). Each case trains a tiny Llama for 4 SGD steps; losses must match one
process within 1e-5 relative and every updated weight within 1e-5 (SGD moves weights by ~5e-3
here). Cases of one world size share a launch (one torch start-up per rank)."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from neuron_parallel.testing.ranks import run_ranks

CHECK = Path(__file__).with_name("dist_pp_check.py")
TOL = 1e-5

CASES = {
    # GPipe, with DTensor logits and loss (vocab-parallel lm_head on a tp mesh of one) under
    # loss_parallel(), as TP + PP produces them.
    "pp2-gpipe-loss-parallel": (2, ["--schedule", "gpipe", "--mb", "4", "--loss-parallel"]),
    "pp4-1f1b": (4, ["--schedule", "1f1b", "--mb", "4"]),
    # 1F1B with activation checkpointing, an uneven user split and gradient accumulation over
    # two step() calls (which torch's own scale_grads=True would get wrong).
    "pp2-1f1b-recompute-accum": (
        2,
        ["--schedule", "1f1b", "--mb", "4", "--recompute", "1", "--layer-split", "1,3", "--accum", "2"],
    ),
    # Interleaved 1F1B, tied embeddings with the first and last stage on different ranks
    # (gradients summed over send/recv).
    "pp2-interleaved-tied": (2, ["--schedule", "interleaved_1f1b", "--virtual-stages", "2", "--mb", "4", "--tied"]),
    # Zero-bubble V, tied, with the first and last stage both on rank 0 (summed locally).
    "pp2-zbv-tied": (2, ["--schedule", "zbv", "--virtual-stages", "2", "--mb", "4", "--tied"]),
}

# Launches: name -> cases of one world size. test_parity.py runs pp2, pp4, interleaved 1F1B with
# recompute and tied pp2 through the real entry point in `make test`; the fast launch adds GPipe
# (with loss parallel) to the two cases it does not cover, in a single torchrun.
LAUNCHES = {
    "pp2-1f1b-accum+zbv+gpipe": ["pp2-1f1b-recompute-accum", "pp2-zbv-tied", "pp2-gpipe-loss-parallel"],
    "pp4-1f1b": ["pp4-1f1b"],
    "pp2-interleaved-tied": ["pp2-interleaved-tied"],
}
FAST = {"pp2-1f1b-accum+zbv+gpipe"}


@pytest.mark.parametrize(
    "launch", [pytest.param(name, marks=() if name in FAST else pytest.mark.slow) for name in LAUNCHES]
)
def test_pipeline_matches_one_process(launch):
    names = LAUNCHES[launch]
    (nproc,) = {CASES[n][0] for n in names}
    r = run_ranks(CHECK, nproc, [f"{n}={shlex.join(CASES[n][1])}" for n in names], timeout=120 * len(names))
    assert r.returncode == 0, r.tail()
    assert sorted((x["case"], x["rank"]) for x in r.results) == sorted((n, k) for n in names for k in range(nproc))
    for x in r.results:
        assert x["ok"] and x["max_loss_rel"] <= TOL and x["max_weight_diff"] <= TOL, (x, r.tail(3000))
