"""The whole pipeline as a Prefect flow on a real local Prefect server, uploading to a local
Hub-compatible server over HTTP, then loading and generating from the consolidated model."""

import hashlib
from pathlib import Path

import pytest
import torch

from neuron_flows.tasks.config import FinetuneConfig
from neuron_parallel.checkpoint.output import OWNER_FILE

from ..conftest import HUB_PORT
from ..hub_server import LocalHub


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _tiny_run(tiny_world, tmp_path, *overrides: str) -> FinetuneConfig:
    """The tiny model on the pydoc corpus, 32-token blocks, micro batch 2, in ``tmp_path``."""
    return FinetuneConfig.load(
        None,
        [
            f"model.name_or_path={tiny_world['model']}",
            f"data.source={tiny_world['corpus']}",
            "data.block_size=32",
            f"data.cache_dir={tmp_path / 'datasets'}",
            "train.micro_batch_size=2",
            f"output.dir={tmp_path / 'run'}",
            *overrides,
        ],
    )


@pytest.fixture
def hub(tmp_path):
    with LocalHub(tmp_path / "hub", port=HUB_PORT) as server:
        yield server


def test_pipeline_end_to_end(prefect_server, tiny_world, tmp_path, hub, monkeypatch):
    from huggingface_hub import snapshot_download
    from prefect.client.orchestration import get_client
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from neuron_flows.flows.finetune import finetune

    monkeypatch.setenv("HF_TOKEN", hub.token)
    repo = f"{hub.user}/tiny-llama-ft"
    config = _tiny_run(
        tiny_world,
        tmp_path,
        "launch.nproc_per_node=2",
        "train.max_steps=4",
        "train.save_every=2",
        f"hub.repo_id={repo}",
        f"hub.endpoint={hub.url}",
    )
    state = finetune(config, return_state=True)
    assert state.is_completed(), state
    result = state.result()
    assert result["final_step"] == 4
    assert result["run_dir"] == str(tmp_path / "run")
    assert result["hub_url"] and repo in result["hub_url"]
    consolidated = Path(result["consolidated"])
    assert (tmp_path / "run" / "metrics.jsonl").exists()
    assert {"config.json", "generation_config.json", "tokenizer.json", "model.safetensors", "README.md"} <= {
        p.name for p in consolidated.iterdir()
    }

    # What the Hub holds is byte for byte what was consolidated.
    snap = Path(snapshot_download(repo, endpoint=hub.url, token=hub.token, cache_dir=tmp_path / "hf-cache"))
    local = {p.relative_to(consolidated).as_posix(): _sha(p) for p in consolidated.rglob("*") if p.is_file()}
    assert local.pop(OWNER_FILE)  # the marker of a directory neuron-flows wrote stays local
    remote = {p.relative_to(snap).as_posix(): _sha(p) for p in snap.rglob("*") if p.is_file()}
    assert remote.pop(".gitattributes")  # the Hub's own, created with the repo
    assert remote == local
    # What is published names this machine's paths (model, data, cache, run) by their last part only.
    here = (str(tmp_path), str(Path(tiny_world["model"]).parent))
    assert not [(p.name, x) for p in snap.rglob("*") if p.is_file() for x in here if x.encode() in p.read_bytes()]

    # The consolidated model loads with from_pretrained and generates.
    model = AutoModelForCausalLM.from_pretrained(snap)
    tok = AutoTokenizer.from_pretrained(snap)
    ids = tok("The for statement", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 8
    assert isinstance(tok.decode(out[0]), str)

    # Each step ran as a task of the flow run, and the plan is an artifact.
    async def task_names():
        async with get_client() as client:
            runs = await client.read_task_runs()
            return {r.name.rsplit("-", 1)[0] for r in runs if r.flow_run_id == state.state_details.flow_run_id}

    import asyncio

    assert {"tokenize", "plan", "train", "validate", "consolidate", "upload"} <= asyncio.run(task_names())

    # The run's summary: loss curve (PNG, also in the run directory), checkpoints, model, Hub commit.
    async def artifacts():
        from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

        async with get_client() as client:
            flt = ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[state.state_details.flow_run_id]))
            return {a.key: a for a in await client.read_artifacts(artifact_filter=flt)}

    arts = asyncio.run(artifacts())
    summary = arts["summary"].data
    assert "![loss curve](data:image/png;base64," in summary and result["hub_url"] in summary
    assert "checkpoint-4" in summary and str(consolidated) in summary
    # Its sources by identity, left for the next run of the same fine-tune to compare against.
    assert "| model and data revisions | " in summary  # first run, or what changed since another test's
    assert any(key.startswith("lineage-") and arts[key].type == "table" for key in arts), sorted(arts)
    assert (tmp_path / "run" / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert arts["plan"].type == "table" and "tp=1 pp=1 dp=2" in str(arts["plan"].data)
    assert arts["data-audit"].type == "table" and "trained_fraction" in str(arts["data-audit"].data)
    assert arts["data-sample"].type == "markdown"


def _earlier_model(path: Path) -> dict[str, str]:
    """An earlier run's model at ``path`` (a neuron-flows output), by file and sha256."""
    from neuron_parallel.checkpoint import export_checkpoint

    fixture = Path(__file__).resolve().parents[1] / "fixtures" / "optimum-neuron" / "ckpt_tp2_base"
    export_checkpoint(fixture, path)
    (path / "README.md").write_text("the earlier run's card")
    return {p.relative_to(path).as_posix(): _sha(p) for p in path.rglob("*") if p.is_file()}


def test_pipeline_without_a_repo_still_succeeds(prefect_server, tiny_world, tmp_path):
    """And the new model replaces the earlier run's in a reused ``output.consolidated_dir``."""
    from neuron_flows.flows.finetune import finetune

    earlier = _earlier_model(tmp_path / "models" / "ft")
    config = _tiny_run(tiny_world, tmp_path, "train.max_steps=2", f"output.consolidated_dir={tmp_path / 'models/ft'}")
    result = finetune(config)
    model = Path(result["consolidated"])
    assert result["hub_url"] is None and model == tmp_path / "models" / "ft" and (model / "model.safetensors").exists()
    now = {p.relative_to(model).as_posix(): _sha(p) for p in model.rglob("*") if p.is_file()}
    assert now["model.safetensors"] != earlier["model.safetensors"] and now["README.md"] != earlier["README.md"]
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["ft"]  # nothing left staged


def test_failed_upload_rolls_back_the_consolidation(prefect_server, tiny_world, tmp_path, hub, monkeypatch):
    """Consolidate and upload are one transaction: an upload that fails (the server cuts every
    commit, both attempts) drops the model it consolidated, and the earlier run's model in the
    reused ``output.consolidated_dir`` stays byte for byte; the checkpoints stay."""
    from neuron_flows.flows.finetune import finetune

    monkeypatch.setenv("HF_TOKEN", hub.token)
    for _ in range(8):  # more than every attempt the upload step and its client make
        hub.fail_next_commit()
    models = tmp_path / "models"
    earlier = _earlier_model(models / "ft")
    config = _tiny_run(
        tiny_world,
        tmp_path,
        "train.max_steps=2",
        f"hub.repo_id={hub.user}/x",
        f"hub.endpoint={hub.url}",
        f"output.consolidated_dir={models / 'ft'}",
    )
    state = finetune(config, return_state=True)
    assert state.is_failed()
    assert (tmp_path / "run" / "checkpoint-2" / "COMPLETE").exists()
    assert {p.relative_to(models / "ft").as_posix(): _sha(p) for p in (models / "ft").rglob("*") if p.is_file()} == (
        earlier
    )
    assert sorted(p.name for p in models.iterdir()) == ["ft"]  # the staged model is gone
