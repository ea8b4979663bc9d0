"""Real torchrun training: dp parity with one rank, exact resume after a crash, checkpoint
validation and consolidation back to a Hugging Face model."""

import shutil

import pytest
import torch
from safetensors.torch import load_file

from neuron_parallel.checkpoint import (
    CheckpointTensors,
    export_checkpoint,
    list_checkpoints,
    validate_checkpoint,
)
from neuron_parallel.checkpoint.resume import find_resume_checkpoint
from neuron_parallel.train import FAIL_AFTER_ENV

from ..conftest import read_metrics, torchrun, write_job
from ..unit.test_reporting import tensorboard_scalars

STEPS = 6
TRAIN = dict(max_steps=STEPS, save_every=2, keep_checkpoints=0, lr=2e-3, warmup_steps=1, seed=1)


@pytest.fixture(scope="module")
def dp2_run(tiny_world, tiny_dataset, tmp_path_factory):
    """An uninterrupted 2-rank data-parallel run."""
    run = tmp_path_factory.mktemp("dp2")
    job = write_job(run, tiny_world["model"], tiny_dataset.path, world=2, train=dict(TRAIN, micro_batch_size=4))
    proc = torchrun(job, 2)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return run


def test_dp2_equals_one_rank_with_the_same_global_batch(dp2_run, tiny_world, tiny_dataset, tmp_path):
    job = write_job(
        tmp_path,
        tiny_world["model"],
        tiny_dataset.path,
        world=1,
        train=dict(TRAIN, micro_batch_size=4, save_every=0),
        grad_accum=2,
    )
    proc = torchrun(job, 1)
    assert proc.returncode == 0, proc.stderr
    one, two = read_metrics(tmp_path), read_metrics(dp2_run)
    assert [m["step"] for m in two] == list(range(1, STEPS + 1))
    for a, b in zip(one, two):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]), (a, b)
        assert a["lr"] == b["lr"] and a["tokens_seen"] == b["tokens_seen"]
    assert two[-1]["loss"] < two[0]["loss"]
    assert {"step", "loss", "lr", "tokens_per_s"} <= set(two[0])
    assert_tensorboard_matches_metrics(dp2_run)


def assert_tensorboard_matches_metrics(run_dir) -> None:
    """The run's TensorBoard event files, read by TensorBoard, hold exactly one loss per step of
    metrics.jsonl, equal to it as float32."""
    metrics = read_metrics(run_dir)
    scalars = tensorboard_scalars(run_dir, "train/loss")
    assert sorted(scalars) == [m["step"] for m in metrics]
    for m in metrics:
        assert scalars[m["step"]] == [pytest.approx(m["loss"], rel=1e-6)], (m["step"], scalars[m["step"]])
    assert set(tensorboard_scalars(run_dir, "train/grad_norm")) == set(scalars)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy:DeprecationWarning")  # inside mlflow's store
def test_resume_after_a_crash_continues_exactly(dp2_run, tiny_world, tiny_dataset, tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # the default store: <run dir>/mlflow.db
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    train = dict(TRAIN, micro_batch_size=4, report_to=["tensorboard", "mlflow"])
    job = write_job(tmp_path, tiny_world["model"], tiny_dataset.path, world=2, train=train)
    crashed = torchrun(job, 2, env={FAIL_AFTER_ENV: "2"})
    assert crashed.returncode != 0
    assert [c.name for c in list_checkpoints(tmp_path)] == ["checkpoint-2"]
    job = write_job(tmp_path, tiny_world["model"], tiny_dataset.path, world=2, train=dict(train, log_every=2))
    resumed = torchrun(job, 2)
    assert resumed.returncode == 0, resumed.stderr
    assert '"event": "resumed", "step": 2' in resumed.stdout
    ours = read_metrics(tmp_path)
    ref = read_metrics(dp2_run)
    assert [m["step"] for m in ours] == list(range(1, STEPS + 1))
    assert [m["loss"] for m in ours[2:]] == [m["loss"] for m in ref[2:]]
    steps = [e for e in resumed.events if e["event"] == "step"]
    assert [e["step"] for e in steps] == [4, 6] and steps[0]["eta_s"] > 0 and steps[-1]["eta_s"] == 0
    assert_tensorboard_matches_metrics(tmp_path)
    assert_one_mlflow_run_matches_metrics(tmp_path, ours)
    a = export_checkpoint(tmp_path, tmp_path / "hf")
    b = export_checkpoint(dp2_run, tmp_path / "hf_ref")
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def assert_one_mlflow_run_matches_metrics(run_dir, metrics: list[dict]) -> None:
    """The crashed and the resumed run logged into one MLflow run (the default store in the run
    directory), read with MlflowClient: its params, its metric history, its status."""
    from mlflow.tracking import MlflowClient

    from neuron_parallel.reporting import tag_mlflow_run

    client = MlflowClient(f"sqlite:///{run_dir.resolve()}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("neuron-flows").experiment_id])
    assert run.info.status == "FINISHED" and run.data.tags["resumed_from_step"] == "2"
    assert run.data.params["train.lr"] == str(TRAIN["lr"]) and run.data.params["parallel.dp"] == "2"
    assert run.data.params["train.log_every"] == "1" and run.data.tags["resume.train.log_every"] == "2"
    history = sorted(client.get_metric_history(run.info.run_id, "train/loss"), key=lambda m: m.step)
    assert [(m.step, m.value) for m in history] == [(m["step"], m["loss"]) for m in metrics]
    assert tag_mlflow_run(run_dir, {"consolidated_model": "/models/ft"}) == run.info.run_id
    assert client.get_run(run.info.run_id).data.tags["consolidated_model"] == "/models/ft"


def test_checkpoint_is_valid_and_consolidates_to_the_trained_model(dp2_run, tmp_path):
    from transformers import AutoModelForCausalLM

    from neuron_parallel.models.causal_lm import CausalLMStage, build_meta_model, load_config, load_weights, materialize

    ckpt = list_checkpoints(dp2_run)[-1]
    assert validate_checkpoint(ckpt) == []
    out = export_checkpoint(dp2_run, tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(out).eval()

    # The trained model as training holds it: a stage module loaded from the sharded checkpoint.
    config = load_config(ckpt)
    stage = CausalLMStage(build_meta_model(config), range(config.num_hidden_layers), first=True, last=True)
    materialize(stage, torch.device("cpu"))
    load_weights(stage, CheckpointTensors(ckpt), tied=False)
    tensors = CheckpointTensors(ckpt)
    consolidated = load_file(out / "model.safetensors")
    for name in tensors.names("model"):
        assert torch.equal(consolidated[name], tensors.read(name)), name
    ids = torch.randint(0, config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    stage.eval()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, stage(ids))


def test_sharded_and_pytorch_exports(dp2_run, tmp_path):
    from transformers import AutoModelForCausalLM

    sharded = export_checkpoint(dp2_run, tmp_path / "sharded", max_shard_size="1MB")
    assert len(list(sharded.glob("model-*-of-*.safetensors"))) > 1
    assert (sharded / "model.safetensors.index.json").exists()
    single = export_checkpoint(dp2_run, tmp_path / "single")
    a = AutoModelForCausalLM.from_pretrained(sharded).state_dict()
    b = AutoModelForCausalLM.from_pretrained(single).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in b)
    pt = export_checkpoint(dp2_run, tmp_path / "pt", fmt="pytorch")
    state = torch.load(pt / "pytorch_model.bin", weights_only=True)
    assert all(torch.equal(state[k], b[k]) for k in state)


def _corrupt_copy(src, dst, how):
    shutil.copytree(src, dst)
    shard = dst / "shards/tp_rank_00_pp_rank_00/model.safetensors"
    if how == "flip":
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x01
        shard.write_bytes(bytes(data))
        return "sha256 mismatch", shard
    if how == "truncate":
        shard.write_bytes(shard.read_bytes()[:-100])
        return "size", shard
    if how == "missing":
        shard.unlink()
        return "missing", shard
    (dst / "COMPLETE").unlink()
    return "missing (the save did not finish)", dst / "COMPLETE"


@pytest.mark.parametrize("how", ["flip", "truncate", "missing", "no_complete"])
def test_corruption_is_named_and_resume_falls_back(dp2_run, tmp_path, how):
    import subprocess
    import sys

    ckpts = list_checkpoints(dp2_run)
    run = tmp_path / "run"
    shutil.copytree(ckpts[-2], run / ckpts[-2].name)
    expect, path = _corrupt_copy(ckpts[-1], run / ckpts[-1].name, how)
    problems = validate_checkpoint(run / ckpts[-1].name)
    assert any(str(path) in p and expect in p for p in problems), problems
    proc = subprocess.run(
        [sys.executable, "-m", "neuron_flows.flows.cli", "validate", str(run / ckpts[-1].name)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 1 and str(path) in proc.stdout
    chosen, skipped = find_resume_checkpoint(run)
    assert chosen == run / ckpts[-2].name
    assert len(skipped) == 1 and ckpts[-1].name in skipped[0]
    # A flipped byte is caught by its checksum, the rest by the completeness check.
    with pytest.raises(ValueError, match="the file changed after" if how == "flip" else "refusing to consolidate"):
        export_checkpoint(run / ckpts[-1].name, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_bf16_compute_with_fp32_master_weights_tracks_fp32(dp2_run, tiny_world, tiny_dataset, tmp_path):
    job = write_job(
        tmp_path,
        tiny_world["model"],
        tiny_dataset.path,
        world=2,
        parallel=dict(mixed_precision="bf16"),
        train=dict(TRAIN, micro_batch_size=4),
    )
    proc = torchrun(job, 2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    bf16, fp32 = read_metrics(tmp_path), read_metrics(dp2_run)
    assert all(abs(a["loss"] - b["loss"]) <= 5e-3 * b["loss"] for a, b in zip(bf16, fp32)), (bf16, fp32)
    assert any(a["loss"] != b["loss"] for a, b in zip(bf16, fp32))  # it really ran in bf16
    ckpt = CheckpointTensors(list_checkpoints(tmp_path)[-1])
    assert ckpt.manifest.tensors["model.norm.weight"].dtype == "float32"  # master weights stay fp32
