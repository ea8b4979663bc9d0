"""`neuron-flows train`: a 3D layout and a two-agent multi-node launch give the losses of one
process."""

import os
import socket
import subprocess
import sys

import pytest

from ..conftest import ROOT, read_metrics

STEPS = 4


def _base(tiny_world, tmp_path, run):
    return [
        "--set",
        f"model.name_or_path={tiny_world['model']}",
        "--set",
        f"data.source={tiny_world['corpus']}",
        "--set",
        f"data.cache_dir={tmp_path / 'datasets'}",
        "--set",
        f"train.max_steps={STEPS}",
        "--set",
        "train.save_every=0",
        "--set",
        "data.block_size=32",
        "--set",
        f"output.dir={tmp_path / run}",
        "--set",
        "train.global_batch_size=8",
    ]


def _train(args, env=None):
    return subprocess.Popen(
        [sys.executable, "-m", "neuron_flows.flows.cli", "train", str(ROOT / "configs/tiny-llama-cpu.yaml"), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=env or {**os.environ, "OMP_NUM_THREADS": "1"},
    )


def _finish(proc, timeout=400):
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-2000:] + err[-4000:]
    return out


def _close(a, b):
    assert [m["step"] for m in a] == [m["step"] for m in b] == list(range(1, STEPS + 1))
    for x, y in zip(a, b):
        assert abs(x["loss"] - y["loss"]) <= 1e-5 * y["loss"], (x, y)


@pytest.fixture(scope="module")
def one_rank(tiny_world, tmp_path_factory):
    """The reference: the same global batch of 8 on one process (tp and pp pinned to 1)."""
    base = tmp_path_factory.mktemp("one-rank")
    out = _finish(
        _train(
            _base(tiny_world, base, "one")
            + ["--set", "parallel.tp=1", "--set", "parallel.pp=1", "--set", "launch.nproc_per_node=1"]
        )
    )
    assert out.strip().splitlines()[-1] == f"run: {base / 'one'}"
    return read_metrics(base / "one")


@pytest.mark.slow  # the layout's parity runs in the fast tier (tests/dist/test_parity.py, tp2-pp2)
def test_tp2_pp2_on_four_ranks_equals_one_rank(tiny_world, tmp_path, one_rank):
    """tp and pp pinned, the rest (ZeRO-1, SP, microbatching, recompute) left to the planner."""
    out = _finish(
        _train(
            _base(tiny_world, tmp_path, "tp2pp2")
            + ["--set", "parallel.tp=2", "--set", "parallel.pp=2", "--set", "launch.nproc_per_node=4"]
        )
    )
    assert out.strip().splitlines()[-1] == f"run: {tmp_path / 'tp2pp2'}"
    assert "plan: chosen by the planner for cpu: tp=2 pp=2 dp=1" in out
    _close(read_metrics(tmp_path / "tp2pp2"), one_rank)


@pytest.mark.slow
def test_two_agents_multi_node_dp2_tp2(tiny_world, tmp_path, one_rank):
    """Node 0 runs `neuron-flows train` with nnodes=2 and publishes the launch; node 1 is
    `neuron-flows join`, as on Kubernetes (deployments/trn2), and knows nothing but the file."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launch_file = tmp_path / "launch" / "job.json"
    node = _base(tiny_world, tmp_path, "multi") + [
        "--set",
        "launch.nnodes=2",
        "--set",
        "launch.nproc_per_node=2",
        "--set",
        f"launch.rdzv_id=test-{port}",
        "--set",
        "parallel.tp=2",
        "--set",
        "parallel.pp=1",
        "--set",
        "parallel.sequence_parallel=true",
    ]
    env = {"NEURON_FLOWS_RDZV_ENDPOINT": f"127.0.0.1:{port}", "NEURON_FLOWS_LAUNCH_FILE": str(launch_file)}
    joiner = subprocess.Popen(
        [sys.executable, "-m", "neuron_flows.flows.cli", "join", "--timeout", "300"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1", **env},
    )
    first = _train(node, env={**os.environ, "OMP_NUM_THREADS": "1", **env})
    _finish(first)
    assert _finish(joiner).strip().splitlines()[-1] == f"run: {tmp_path / 'multi'}"
    _close(read_metrics(tmp_path / "multi"), one_rank)
