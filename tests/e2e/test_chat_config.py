"""configs/tiny-chat-cpu.yaml through the whole flow (`neuron-flows run` against a real local
Prefect server): chat SFT with a held-out eval set, eval loss in metrics.jsonl, in the summary
artifact and in the model card; the data audit as a table artifact."""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ..conftest import ROOT, read_metrics


def _newest_artifacts() -> dict:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.sorting import ArtifactSort

    async def read():
        async with get_client() as client:
            arts = await client.read_artifacts(sort=ArtifactSort.CREATED_DESC, limit=50)
            newest = {}
            for a in arts:
                newest.setdefault(a.key, a)
            return newest

    return asyncio.run(read())


@pytest.mark.slow
def test_tiny_chat_config_runs_the_flow_with_eval(prefect_server, tiny_world, tmp_path):
    from prefect.settings import PREFECT_API_URL

    run = tmp_path / "run"
    sets = {
        "model.name_or_path": tiny_world["model"],
        "data.source": tiny_world["chat"],
        "data.chat_template": Path(tiny_world["chat_templates"]) / "llama3.jinja",
        "data.cache_dir": tmp_path / "datasets",
        "train.max_steps": 4,
        "train.eval_every": 2,
        "train.save_every": 0,
        "output.dir": run,
    }
    cmd = [sys.executable, "-m", "neuron_flows.flows.cli", "run", str(ROOT / "configs/tiny-chat-cpu.yaml")]
    for key, value in sets.items():
        cmd += ["--set", f"{key}={value}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PREFECT_API_URL": PREFECT_API_URL.value()}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    metrics = read_metrics(run)
    evals = {m["step"]: m["eval_loss"] for m in metrics if "eval_loss" in m}
    assert sorted(evals) == [2, 4] and all(math.isfinite(v) for v in evals.values())
    assert all(0 < m["trained_tokens"] < 8 * 256 for m in metrics)  # prompts and padding take no loss

    arts = _newest_artifacts()
    summary = arts["summary"].data
    assert str(run) in summary
    row = re.search(r"\| eval loss \| ([0-9.]+) \(step 2\) → ([0-9.]+) \(step 4\)", summary)
    assert row and float(row.group(2)) == round(evals[4], 4), summary
    table = arts["data-audit"].data
    audit = {r["metric"]: r["value"] for r in (json.loads(table) if isinstance(table, str) else table)}
    assert audit["format"] == "chat" and int(audit["eval_examples"]) == 30
    card = (run / "consolidated" / "README.md").read_text()
    shown = re.search(r"\| eval loss \| ([0-9.]+) \|", card)
    assert shown and abs(float(shown.group(1)) - evals[4]) < 0.01, card
