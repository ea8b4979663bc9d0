"""``bench/gpu.sh``'s dry run on CPU, as documented there: every step of the GPU benchmark (the
trainer through torchrun, the plain loop, the matmul rate, packed-row attention, the trainer's own
steps in bf16 and fp32, the report) on the tiny model, and the one JSON file it writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ..conftest import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_gpu_bench_dry_run_on_cpu(tmp_path):
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "DEVICE": "cpu",
        "MODEL": "tiny",
        "SEQ": "128",
        "MBS": "2",
        "STEPS": "4",
        "WARMUP": "1",
        "WORKDIR": str(tmp_path / "work"),
        "RESULTS": str(tmp_path / "results"),
        "TIME_LIMIT_S": "840",
    }
    proc = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu.sh")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=870
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
    r = json.loads((tmp_path / "results" / "gpu_cpu_tiny.json").read_text())
    assert r["missing"] == [], r["missing"]

    # The trainer and the plain loop: the same weights and batches give the same losses, both timed.
    assert r["max_loss_difference"] < 1e-5, r["max_loss_difference"]
    assert r["ours_tokens_per_s"] > 0 and r["plain_tokens_per_s"] > 0
    assert r["log_every"] == 1  # gcd(WARMUP, STEPS): a synchronize after every step
    assert r["matmul"]["flops_per_s"] > 0 and r["mfu_ours_vs_matmul"] > 0
    assert r["memory_predicted_bytes"] > 0 and r["memory_measured_bytes"] > 0

    # Host syncs: CUDA's sync debug mode has no CPU counterpart.
    assert r["host_syncs_per_step"] == "not applicable"

    # Packed rows on CPU: the trainer's additive mask equals the explicit boolean mask, forward and
    # backward; FlexAttention's forward agrees to bf16 rounding.
    attention = r["packed_attention"]
    assert set(attention["paths"]) == {"ours", "explicit_sdpa", "flex_forward"}
    parity = attention["ours_vs_explicit_sdpa"]
    assert set(parity) == {"out", "grad_q", "grad_k", "grad_v"}
    assert all(v["max_rel"] < 1e-2 for v in parity.values()), parity
    assert attention["flex_forward_vs_explicit_sdpa"]["out"]["max_rel"] < 2e-2
    assert attention["ours_as_exact_as_explicit"] is True

    # bf16 against fp32: three steps of the trainer, the bf16 ones equal to the torchrun run's.
    losses = r["loss_parity_bf16_vs_fp32"]
    assert losses["steps"] == 3 and losses["ok"], losses
    ours = [row["loss"] for row in map(json.loads, (tmp_path / "work" / "run" / "metrics.jsonl").open())]
    assert r["bf16_steps"]["loss"][:3] == pytest.approx(ours[:3], rel=1e-6)
    assert "host syncs per step: not applicable" in proc.stdout
