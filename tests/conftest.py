"""Shared fixtures: a tiny model and corpus built once per session, a tokenized dataset, a real
local Prefect server, and helpers that launch real torchrun jobs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def tiny_world(tmp_path_factory) -> dict[str, str]:
    """A tiny Llama (4 layers, 4 heads, 2 KV heads), its BPE tokenizer and the pydoc corpus."""
    from neuron_parallel.tiny import make_tiny_world

    return make_tiny_world(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def tiny_dataset(tiny_world, tmp_path_factory):
    from neuron_parallel.data import tokenize_dataset

    return tokenize_dataset(
        source=tiny_world["corpus"],
        tokenizer_dir=tiny_world["model"],
        block_size=32,
        cache_dir=tmp_path_factory.mktemp("datasets"),
    )


@pytest.fixture(scope="session")
def prefect_server():
    """One real Prefect server (temporary SQLite database) for the whole session."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


def write_job(
    run_dir: Path,
    model: str,
    dataset: str,
    *,
    world: int,
    block_size: int = 32,
    parallel: dict | None = None,
    train: dict | None = None,
) -> Path:
    """A job.json for ``python -m neuron_parallel.train``: dp derived from ``world``."""
    from neuron_parallel.config import JobConfig, ParallelConfig, TrainConfig

    job = JobConfig(
        model_path=model,
        dataset_path=dataset,
        output_dir=str(run_dir),
        block_size=block_size,
        parallel=ParallelConfig.for_world(world, **(parallel or {})),
        train=TrainConfig(**(train or {})),
    )
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "job.json"
    path.write_text(job.to_json())
    return path


def torchrun(job_path: Path, nproc: int, *, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run the real training entry point under torchrun."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        "neuron_parallel.train",
        str(job_path),
    ]
    return subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
    )


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line.strip()]
