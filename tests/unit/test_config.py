"""Config model: YAML, --set overrides, misspelt keys, derived dp, conversion to the library."""

import json
import subprocess
import sys
import time

import pytest

from neuron_flows.tasks.config import FinetuneConfig
from neuron_parallel.config import JobConfig, ParallelConfig

from ..conftest import PINNED_LAYOUT, ROOT

TINY = ROOT / "configs" / "tiny-llama-cpu.yaml"
FIXED = PINNED_LAYOUT


def test_tiny_config_loads_with_required_keys():
    cfg = FinetuneConfig.load(TINY)
    for key in (
        "parallel.tp",
        "parallel.pp",
        "parallel.zero_1",
        "parallel.sequence_parallel",
        "parallel.num_microbatches",
        "train.max_steps",
        "train.save_every",
        "train.seed",
        "train.micro_batch_size",
        "train.global_batch_size",
        "train.lr",
        "data.block_size",
        "launch.nproc_per_node",
        "output.dir",
        "hub.repo_id",
        "hub.endpoint",
    ):
        section, name = key.split(".")
        assert hasattr(getattr(cfg, section), name), key
    assert cfg.launch.nproc_per_node == 2 and not set(cfg.pinned()) & {"tp", "pp", "zero_1"}


def test_layout_fields_default_to_auto():
    cfg = FinetuneConfig()
    assert cfg.parallel.tp == cfg.parallel.pp == cfg.parallel.zero_1 == "auto"
    assert cfg.pinned() == {} and cfg.hardware == "cpu"
    assert FinetuneConfig.load(None, ["launch.device=neuron"]).hardware == "trn2.48xlarge"


def test_auto_precision_is_what_the_device_runs_once_the_job_is_built(tiny_world):
    from neuron_flows.tasks import steps
    from neuron_parallel.config import LaunchConfig

    assert ParallelConfig().mixed_precision == FinetuneConfig().parallel.mixed_precision == "auto"
    for device, runs in (("cpu", "fp32"), ("cuda", "bf16"), ("neuron", "bf16")):
        job = JobConfig(model_path="m", dataset_path="d", output_dir="o", launch=LaunchConfig(device=device))
        assert job.parallel.mixed_precision == runs
        assert JobConfig.from_dict(json.loads(job.to_json())).parallel.mixed_precision == runs
    given = JobConfig(model_path="m", dataset_path="d", output_dir="o", parallel=ParallelConfig(mixed_precision="bf16"))
    assert given.parallel.mixed_precision == "bf16"
    cfg = FinetuneConfig.load(TINY, [f"model.name_or_path={tiny_world['model']}"])
    layout, search = steps.plan(cfg, tiny_world["model"])  # planned as it runs: fp32 on cpu
    assert search.precision == "fp32" and layout.parallel.mixed_precision == "fp32"


def test_overrides_are_typed_and_dp_is_derived():
    cfg = FinetuneConfig.load(
        TINY,
        [
            *FIXED,
            "parallel.tp=2",
            "launch.nproc_per_node=8",
            "train.lr=1e-4",
            "train.micro_batch_size=2",
            "parallel.zero_1=true",
            "hub.repo_id=alice/x",
        ],
    )
    assert cfg.parallel.tp == 2 and cfg.train.lr == 1e-4 and cfg.parallel.zero_1 is True
    assert {"tp", "pp", "zero_1"} <= set(cfg.pinned())
    assert cfg.hub.repo_id == "alice/x"
    job = cfg.to_job(model_path="", dataset_path="", layout=cfg.pinned_layout())
    assert job.parallel.dp == 4  # 8 ranks / (tp 2 × pp 1)
    assert job.global_batch_size == 16 and job.train.micro_batch_size * job.grad_accum * 4 == 16
    partial = FinetuneConfig.load(TINY, ["parallel.tp=2", "parallel.zero_1=true"])
    assert {k: partial.pinned()[k] for k in ("tp", "zero_1")} == {"tp": 2, "zero_1": True}


def test_global_batch_size_must_divide_into_micro_batches_of_every_dp_rank():
    assert FinetuneConfig.load(TINY, [*FIXED, "train.global_batch_size=16"]).train.global_batch_size == 16
    # two dp ranks of 4 sequences cannot make 12: refused at load, naming micro batches that work
    with pytest.raises(
        ValueError,
        match=r"global_batch_size=12 is not a multiple of train.micro_batch_size × dp = 4 × 2; "
        r"use micro_batch_size in \[1, 2, 3, 6\]",
    ):
        FinetuneConfig.load(TINY, [*FIXED, "train.global_batch_size=12", "train.micro_batch_size=4"])
    with pytest.raises(ValueError, match=r"global_batch_size=16 is not a multiple of train.micro_batch_size=3"):
        FinetuneConfig.load(TINY, ["train.micro_batch_size=3"])  # an auto layout: checked without the split


def test_auto_layout_refusals_name_the_fix():
    with pytest.raises(ValueError, match="layer_split needs a fixed parallel.pp"):
        FinetuneConfig.load(None, ["parallel.layer_split=[2,2]"])
    with pytest.raises(ValueError, match="does not model pipeline_schedule=zbv"):
        FinetuneConfig.load(None, ["parallel.pipeline_schedule=zbv"])


@pytest.mark.parametrize(
    "override, expect",
    [
        ("parallel.tpp=2", "did you mean parallel.tp"),
        ("trian.lr=1", "did you mean train"),
        ("train.max_step=3", "train.max_steps"),
    ],
)
def test_misspelt_key_names_the_valid_ones(override, expect):
    with pytest.raises(ValueError, match="unknown config key") as e:
        FinetuneConfig.load(TINY, [override])
    assert expect in str(e.value)


def test_split_that_does_not_divide_world_names_the_fix():
    with pytest.raises(ValueError) as e:
        FinetuneConfig.load(TINY, ["parallel.tp=3", "launch.nproc_per_node=4"])
    msg = str(e.value)
    assert "world size 4" in msg and "cp × tp × pp = 1 × 3 × 1 = 3" in msg and "tp=2, pp=1" in msg


def test_bad_values_are_reported_with_their_key():
    with pytest.raises(ValueError, match="train.lr"):
        FinetuneConfig.load(TINY, ["train.lr=-1"])
    with pytest.raises(ValueError, match="sequence_parallel needs parallel.tp > 1"):
        FinetuneConfig.load(TINY, ["parallel.tp=1", "parallel.sequence_parallel=true"])
    with pytest.raises(ValueError, match="sequence_parallel needs parallel.tp > 1"):
        FinetuneConfig.load(TINY, [*FIXED, "parallel.sequence_parallel=true"])
    with pytest.raises(ValueError, match="--set"):
        FinetuneConfig.load(TINY, ["parallel.tp"])


def test_job_round_trips_through_json(tmp_path, tiny_world):
    from neuron_flows.tasks import steps

    cfg = FinetuneConfig.load(
        TINY, [*FIXED, "parallel.pp=2", "parallel.num_microbatches=2", f"model.name_or_path={tiny_world['model']}"]
    )
    layout, _ = steps.plan(cfg, tiny_world["model"])
    job = cfg.to_job(model_path="m", dataset_path="d", layout=layout)
    assert job.parallel == ParallelConfig(pp=2, dp=1, num_microbatches=2, mixed_precision="fp32")  # auto on cpu
    (tmp_path / "job.json").write_text(job.to_json())
    assert JobConfig.load(tmp_path / "job.json") == job
    assert job.global_batch_size == job.grad_accum * job.train.micro_batch_size * job.parallel.dp


def test_flow_parameter_schema_is_the_config():
    from prefect.utilities.callables import parameter_schema

    from neuron_flows.flows.finetune import finetune

    schema = parameter_schema(finetune).model_dump()
    assert "config" in schema["properties"]
    defs = schema["definitions"]
    assert {"ParallelSection", "TrainSection", "HubSection"} <= set(defs)
    assert "tp" in defs["ParallelSection"]["properties"]


@pytest.mark.parametrize("override", ["parallel.tp=3", "parallel.tpp=2"])
def test_cli_refuses_bad_config_fast_before_tokenizing(tmp_path, override):
    cache = tmp_path / "datasets"
    t0 = time.perf_counter()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "neuron_flows.flows.cli",
            "run",
            str(TINY),
            "--set",
            override,
            "--set",
            f"data.cache_dir={cache}",
            "--set",
            f"output.dir={tmp_path / 'run'}",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    elapsed = time.perf_counter() - t0
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error: ")
    assert elapsed < 5, f"took {elapsed:.1f}s"
    assert not cache.exists() and not (tmp_path / "run").exists()
