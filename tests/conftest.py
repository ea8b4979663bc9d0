"""Shared fixtures: a tiny model and corpus built once per session, a tokenized dataset, a real
local Prefect server, and helpers that launch real torchrun jobs."""

from __future__ import annotations

import atexit
import json
import os
import random
import shutil
import signal
import socket
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

# The session's own Hugging Face home (``HF_CACHES``), set before huggingface_hub, datasets or
# transformers is imported.
os.environ["HF_HOME"] = tempfile.mkdtemp(prefix="neuron-flows-tests-hf-")
os.environ.update(
    {
        "HF_HUB_CACHE": os.path.join(os.environ["HF_HOME"], "hub"),
        "HF_DATASETS_CACHE": os.path.join(os.environ["HF_HOME"], "datasets"),
        "HF_XET_CACHE": os.path.join(os.environ["HF_HOME"], "xet"),
        "HF_ASSETS_CACHE": os.path.join(os.environ["HF_HOME"], "assets"),
    }
)
os.environ.pop("HUGGINGFACE_HUB_CACHE", None)  # older names that would win over HF_HOME
os.environ.pop("TRANSFORMERS_CACHE", None)

import pytest

from neuron_flows.tasks.config import ALLOWED_HUB_ENDPOINTS_ENV

ROOT = Path(__file__).resolve().parents[1]
HF_CACHES = os.environ["HF_HOME"]
"""The session's own Hugging Face home: what a test fetches, prepares or caches never lands in the
user's ``~/.cache/huggingface``, and nothing cached there is seen by a test. It is in ``os.environ``,
so every process a test starts (CLI commands, services, ranks) uses it too; removed at exit."""
atexit.register(shutil.rmtree, HF_CACHES, ignore_errors=True)


def port_outside_the_ephemeral_range() -> int:
    """A free loopback port below the range the kernel hands out to ``bind(("", 0))`` and to
    outgoing connections, so nothing else of the session takes it between now and its use."""
    ephemeral = Path("/proc/sys/net/ipv4/ip_local_port_range")
    low = int(ephemeral.read_text().split()[0]) if ephemeral.exists() else 32768
    for _ in range(200):
        port = random.randrange(max(1024, low - 10000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free loopback port below {low}")


HUB_PORT = port_outside_the_ephemeral_range()
"""The port of the Hub stand-in (``tests/hub_server.py``, ``LocalHub(..., port=HUB_PORT)``) of the
tests that run the pipeline against it: the one loopback Hub this session's operator allows."""
UNREACHABLE_HUB = "https://127.0.0.1:9"
"""An allowed Hub endpoint where nothing listens (the discard port)."""
# The operator's list of Hub endpoints, for this process and every process it starts (CLI
# commands, `neuron-flows serve`, its worker and flow runs). Set at import, before the warm ranks'
# environment is taken (``_SESSION_ENVIRON``), so it does not make every training job a fresh one.
os.environ[ALLOWED_HUB_ENDPOINTS_ENV] = f"http://127.0.0.1:{HUB_PORT},{UNREACHABLE_HUB}"


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
    grad_accum: int = 1,
    eval_dataset: str | None = None,
) -> Path:
    """A job.json for ``python -m neuron_parallel.train``: dp derived from ``world``; unless
    ``train`` sets ``global_batch_size``, it is micro_batch_size × dp × ``grad_accum``."""
    from neuron_parallel.checkpoint.output import claim_run_dir
    from neuron_parallel.config import DataConfig, JobConfig, ParallelConfig, TrainConfig

    par = ParallelConfig.for_world(world, **(parallel or {}))
    train = dict(train or {})
    train.setdefault("global_batch_size", train.get("micro_batch_size", 4) * par.dp * grad_accum)
    job = JobConfig(
        model_path=model,
        dataset_path=dataset,
        eval_dataset_path=eval_dataset,
        output_dir=str(run_dir),
        data=DataConfig(block_size=block_size),
        parallel=par,
        train=TrainConfig(**train),
    )
    claim_run_dir(run_dir)  # as the launcher does: the ranks train only into a directory of ours
    path = run_dir / "job.json"
    path.write_text(job.to_json())
    return path


def torchrun(job_path: Path, nproc: int, *, env: dict | None = None, timeout: int = 300, fresh: bool = False, hooks=()):
    """Run the real training entry point's job on ``nproc`` ranks; a
    ``neuron_parallel.testing.ranks.RanksResult`` (returncode, stdout, stderr, the entry point's
    events). A job runs on the session's warm ranks of that world size
    (``neuron_parallel.testing.pool``: the same ``train_job``, with ``hooks``, ``"module:function"``
    names, after every checkpoint), unless it needs a process of its own: ``env`` given, the
    environment changed since the session started (a test's ``monkeypatch``), ``fresh``, or
    ``NEURON_FLOWS_TEST_FRESH_RANKS=1``; then ``python -m neuron_parallel.train`` runs it."""
    own = env is not None or fresh or _environ(os.environ) != _SESSION_ENVIRON
    if own or (os.environ.get("NEURON_FLOWS_TEST_FRESH_RANKS") == "1" and not hooks):
        now = _environ(os.environ)
        changed = sorted(k for k in now.keys() | _SESSION_ENVIRON.keys() if now.get(k) != _SESSION_ENVIRON.get(k))
        assert not hooks, f"checkpoint hooks run on warm ranks only (environment changed: {changed})"
        from neuron_parallel.testing.ranks import run_ranks

        return run_ranks("neuron_parallel.train", nproc, [str(job_path)], env=env, timeout=timeout, cwd=ROOT)
    pool = _POOLS.get(nproc)
    if pool is not None and pool.jobs_run >= JOBS_PER_POOL:
        pool.close()
    if pool is None or not pool.alive:
        from neuron_parallel.testing.pool import RankPool

        pool = _POOLS[nproc] = RankPool(nproc, cwd=ROOT)
    return pool.run(job_path, hooks=hooks, timeout=timeout)


_NOT_THE_JOBS = (
    "PYTEST_CURRENT_TEST",
    "TORCHINDUCTOR_CACHE_DIR",
    "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR",
    "KMP_DUPLICATE_LIB_OK",
    "HF_XET_HIGH_PERFORMANCE",
)
"""Variables that do not make an environment another: pytest's own; the ones torch sets itself:
the cache folder, to its default, when ``torch._dynamo`` is first imported (``torch/_inductor/
runtime/cache_dir_utils.py``; ``torch.distributed.pipelining`` imports it), as every rank does
too, and an address in this process's own memory, each time inductor loads a compiled kernel
library (``torch/_inductor/codecache.py``; the in-process compile tests do), which means nothing
to another process; and those libraries set when imported, which no job reads: scikit-learn's
OpenMP setting and lm-eval's Xet download setting (``lm_eval/__init__.py``). Prefect's settings
(``PREFECT_*``, which ``neuron-flows run`` sets for its local server when a test calls it in this process) are not the
jobs' either: the library never imports Prefect."""


JOBS_PER_POOL = 12
"""Jobs a pool of warm ranks trains before it is started anew (``RankPool.jobs_run``)."""


def _environ(environ) -> dict:
    """An environment as a training job sees it (:data:`_NOT_THE_JOBS` apart)."""
    return {k: v for k, v in environ.items() if k not in _NOT_THE_JOBS and not k.startswith("PREFECT_")}


_SESSION_ENVIRON = _environ(os.environ)
"""The environment the warm ranks start with."""
_POOLS: dict = {}
"""The session's warm ranks, by world size (``torchrun``)."""


def pytest_configure(config):
    """SIGTERM (a CI timeout, ``kill``) ends the session as Ctrl-C does: every fixture's teardown
    runs, so the Prefect servers, services and warm ranks the session started end with it."""

    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"stopped by signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)


def close_pools() -> None:
    """End the warm ranks (an idle rank still costs CPU: gloo's connection threads, one per
    process group its jobs made); the next ``torchrun`` starts them again."""
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()


def pytest_sessionfinish(session, exitstatus):
    close_pools()


def kill_9_once(path: Path, timeout_s: float = 240):
    """An ``on_start`` for ``neuron_parallel.testing.ranks.run_ranks``: as soon as ``path`` exists
    (a checkpoint's ``COMPLETE`` marker), SIGKILL torchrun and every rank at once, as a node dying
    would end them."""
    import time

    from neuron_parallel.procs import process_tree

    def kill(proc) -> None:
        deadline = time.monotonic() + timeout_s
        while not path.exists():
            assert proc.poll() is None, f"the run ended before {path} existed"
            assert time.monotonic() < deadline, f"no {path} after {timeout_s} s"
            time.sleep(0.01)
        for pid in process_tree(proc.pid):
            os.kill(pid, signal.SIGKILL)

    return kill


def copy_as_a_crash_leaves_it(run_dir: Path, dest: Path) -> Path:
    """``run_dir`` copied to ``dest`` without its newest checkpoint: the folder a run that crashed
    after its previous checkpoint leaves (the resume truncates ``metrics.jsonl`` past that step)."""
    from neuron_parallel.checkpoint import list_checkpoints

    shutil.copytree(run_dir, dest, ignore=shutil.ignore_patterns(list_checkpoints(run_dir)[-1].name))
    return dest


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line.strip()]


PINNED_LAYOUT = [
    f"parallel.{k}={v}"
    for k, v in (
        ("tp", 1),
        ("pp", 1),
        ("cp", 1),
        ("zero_1", "false"),
        ("sequence_parallel", "false"),
        ("num_microbatches", 1),
        ("pipeline_schedule", "1f1b"),
        ("virtual_stages", 1),
        ("activation_checkpointing", 0),
    )
]
"""``--set`` overrides that pin every layout field to the plain one-stage, no-TP layout."""

OPTIM_STATE_RTOL = 1e-3
"""Optimizer-state parity bound, relative to each tensor's largest value (see test_parity)."""


def max_rel_diff(a, b) -> float:
    """max |a - b| / max |b|: a tolerance that means the same for exp_avg (~1e-3) and exp_avg_sq
    (~1e-8), unlike an absolute one."""
    scale = b.abs().max().item()
    return (a - b).abs().max().item() / scale if scale else (a - b).abs().max().item()
