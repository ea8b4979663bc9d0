"""Hub names through the installed `neuron-flows train`: refused in preflight, within seconds, when
the Hub cannot give them (a same-named dataset in the datasets cache is never taken instead);
resolved to a commit that the run trains on and records, against a local Hub stand-in serving a
model and a dataset repo with two commits; and offline, read from the cache, which the run says."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from huggingface_hub import HfApi, constants

from neuron_parallel.data import tokenize_dataset
from neuron_parallel.hub import upload_model
from neuron_parallel.tiny import write_wikitext_folder

from ..conftest import HF_CACHES, PINNED_LAYOUT, ROOT, UNREACHABLE_HUB
from ..hub_server import LocalHub

CLI = Path(sys.executable).parent / "neuron-flows"
CONFIG = ROOT / "configs" / "tiny-llama-cpu.yaml"
REFUSED_WITHIN_S = 20.0


def _sets(tiny_world: dict, d: Path, **extra: object) -> list[str]:
    values = {
        "model.name_or_path": tiny_world["model"],
        "data.source": tiny_world["corpus"],
        "data.block_size": 32,
        "data.cache_dir": d / "datasets",
        "output.dir": d / "run",
        "launch.nproc_per_node": 1,
        "train.max_steps": 2,
        "train.save_every": 0,
        "train.global_batch_size": 4,
        "train.micro_batch_size": 4,
        **extra,
    }
    args = [f"--set={item}" for item in PINNED_LAYOUT]
    return args + [f"--set={key}={value}" for key, value in values.items()]


def _train(args: list[str], **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "MLFLOW_TRACKING_URI")}
    environ.update({"OMP_NUM_THREADS": "1", "MLFLOW_DISABLE_TELEMETRY": "true", **env})
    cmd = [str(CLI), "train", str(CONFIG), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=400, cwd=ROOT, env=environ)


def _files(*roots: Path) -> dict[str, int]:
    return {str(p): p.stat().st_size for root in roots for p in root.rglob("*") if p.is_file()}


@pytest.mark.parametrize(
    "sets, key, name",
    [
        ({"model.name_or_path": "meta-llama/Llama-3.2-1B"}, "model.name_or_path", "meta-llama/Llama-3.2-1B"),
        ({"data.source": "wikitext", "data.config": "wikitext-2-raw-v1"}, "data.source", "wikitext"),
    ],
)
def test_an_unreachable_hub_name_is_refused_in_seconds(tiny_world, tmp_path, sets, key, name):
    """The Hub out of reach and nothing of that name in the Hugging Face cache: exit 2 within
    seconds, one line with the key, the id and the fix, no traceback, nothing written; the copy
    that datasets keeps of a local folder called ``wikitext`` is not taken for the Hub dataset."""
    tokenize_dataset(  # leaves datasets' prepared copy of the local folder named wikitext in its cache
        source=tiny_world["wikitext"],
        config="wikitext-2-raw-v1",
        tokenizer_dir=tiny_world["model"],
        block_size=32,
        cache_dir=tmp_path / "local-rows",
    )
    assert (Path(HF_CACHES) / "datasets" / "wikitext").is_dir()
    d = tmp_path / "case"
    d.mkdir()
    before = _files(d, Path(HF_CACHES))
    started = time.monotonic()
    proc = _train(_sets(tiny_world, d, **sets), HF_ENDPOINT=UNREACHABLE_HUB)
    took = time.monotonic() - started
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert took < REFUSED_WITHIN_S, f"refused only after {took:.1f} s"
    error = proc.stderr.strip()
    assert "Traceback" not in error and error.count("\n") == 0, error
    assert error.startswith(f"error: {key}={name}: the Hub at {UNREACHABLE_HUB} cannot be reached"), error
    assert "set HF_HUB_OFFLINE=1 with a cache that holds it" in error and f"or point {key} at " in error
    assert "HF_TOKEN" in error
    if key == "data.source":
        assert (
            "datasets/wikitext holds a dataset of that name but not this Hub repo's files, so it is not used" in error
        )
    assert _files(d, Path(HF_CACHES)) == before, "a refusal wrote files"


@pytest.fixture(scope="module")
def hub_repos(tiny_world, tmp_path_factory):
    """The stand-in with the tiny model (one commit) and a wikitext-like dataset repo of two
    commits: the tiny world's folder, then a folder of other, shorter text."""
    root = tmp_path_factory.mktemp("hub-lineage")
    with LocalHub(root / "hub") as hub:
        model = upload_model(tiny_world["model"], repo_id=f"{hub.user}/tiny-llama", endpoint=hub.url, token=hub.token)
        api = HfApi(endpoint=hub.url, token=hub.token)
        dataset = f"{hub.user}/wikitext"
        api.create_repo(dataset, repo_type="dataset")
        second = write_wikitext_folder(["The second commit's text.\n\nIts second paragraph."] * 30, root / "second")
        commits = []
        for folder in (tiny_world["wikitext"], second):
            with pytest.MonkeyPatch.context() as m:  # the stand-in takes LFS uploads, not Xet ones
                m.setattr(constants, "HF_HUB_DISABLE_XET", True)
                commits.append(api.upload_folder(repo_id=dataset, repo_type="dataset", folder_path=str(folder)).oid)
        yield {
            "hub": hub,
            "model": model.repo_id,
            "model_commit": model.revision,
            "dataset": dataset,
            "commits": commits,
        }


def _lineage(run: Path) -> dict:
    (checkpoint,) = sorted(run.glob("checkpoint-*"))
    return json.loads((checkpoint / "trainer_state.json").read_text())["lineage"]


def _audit(d: Path) -> dict:
    (path,) = (d / "datasets").glob("*/audit.json")
    return json.loads(path.read_text())


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy:DeprecationWarning")  # inside mlflow's store
def test_hub_model_and_dataset_at_a_commit_recorded_and_read_offline(hub_repos, tiny_world, tmp_path):
    hub, (first, second) = hub_repos["hub"], hub_repos["commits"]
    model = {"repo": hub_repos["model"], "commit": hub_repos["model_commit"]}
    sets = {"model.name_or_path": hub_repos["model"], "data.source": hub_repos["dataset"]}
    sets["data.config"] = "wikitext-2-raw-v1"
    pinned, newest = tmp_path / "pinned", tmp_path / "newest"

    proc = _train(_sets(tiny_world, pinned, **sets, **{"data.revision": first}), HF_ENDPOINT=hub.url)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    lineage = _lineage(pinned / "run")
    assert lineage["model"] == model
    assert lineage["data"]["source"] == {"key": "data.source", "repo": hub_repos["dataset"], "commit": first}
    assert lineage["data"]["fingerprint"] == _audit(pinned)["lineage"]["fingerprint"]
    assert set(lineage["versions"]) == {"torch", "transformers", "datasets", "huggingface_hub", "neuron-flows"}
    assert str(tmp_path) not in json.dumps(lineage)

    # Unpinned: the newest commit, recorded (and in the MLflow run's params).
    proc = _train(_sets(tiny_world, newest, **sets, **{"train.report_to": "[mlflow]"}), HF_ENDPOINT=hub.url)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert _lineage(newest / "run")["data"]["source"]["commit"] == second
    assert _audit(pinned)["examples"] > 10 * _audit(newest)["examples"]  # the first commit's text, then the short one
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{(newest / 'run').resolve()}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("neuron-flows").experiment_id])
    assert run.data.params["lineage.data.source.commit"] == second
    assert run.data.params["lineage.model.commit"] == model["commit"]

    # Continuing the pinned run unpinned would mix two commits' data in one model: refused.
    proc = _train(_sets(tiny_world, pinned, **sets), HF_ENDPOINT=hub.url)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr and "was trained on another model or other data" in proc.stderr
    assert f"data.source: {hub_repos['dataset']} at commit {first} → {hub_repos['dataset']} at commit {second}" in (
        proc.stderr
    )

    # The stand-in stopped and offline: the pinned run reads both from the cache, says so, and
    # resumes its own checkpoint (the same identities).
    hub.close()
    proc = _train(_sets(tiny_world, pinned, **sets, **{"data.revision": first}), HF_HUB_OFFLINE="1")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    cache = "from the local Hugging Face cache (offline (HF_HUB_OFFLINE=1))"
    assert f"using the model {model['repo']} at commit {model['commit']}, {cache}" in proc.stdout
    assert f"using the dataset {hub_repos['dataset']} at commit {first}, {cache}" in proc.stdout
    assert _lineage(pinned / "run")["data"]["source"]["commit"] == first
