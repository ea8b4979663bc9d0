"""Config model: YAML, --set overrides, misspelt keys, derived dp, conversion to the library."""

import subprocess
import sys
import time

import pytest

from neuron_flows.tasks.config import FinetuneConfig
from neuron_parallel.config import JobConfig, ParallelConfig

from .conftest import ROOT

TINY = ROOT / "configs" / "tiny-llama-cpu.yaml"
FIXED = [
    "parallel.tp=1",
    "parallel.pp=1",
    "parallel.zero_1=false",
    "parallel.sequence_parallel=false",
    "parallel.num_microbatches=1",
    "parallel.pipeline_schedule=1f1b",
    "parallel.virtual_stages=1",
    "parallel.activation_checkpointing=0",
]


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
        "train.grad_accum",
        "train.lr",
        "data.block_size",
        "launch.nproc_per_node",
        "output.dir",
        "hub.repo_id",
        "hub.endpoint",
    ):
        section, name = key.split(".")
        assert hasattr(getattr(cfg, section), name), key
    assert cfg.launch.nproc_per_node == 2 and cfg.parallel.is_auto and cfg.parallel.fixed() == {}
    assert cfg.global_batch_size == 8 * 1 * 2  # micro_batch_size × grad_accum × all ranks
    with pytest.raises(ValueError, match="resolve_layout"):
        cfg.parallel_config()


def test_layout_fields_default_to_auto():
    cfg = FinetuneConfig()
    assert cfg.parallel.tp == cfg.parallel.pp == cfg.parallel.zero_1 == "auto"
    assert cfg.parallel.is_auto and cfg.hardware == "cpu"
    assert FinetuneConfig.load(None, ["launch.device=neuron"]).hardware == "trn2.48xlarge"


def test_overrides_are_typed_and_dp_is_derived():
    cfg = FinetuneConfig.load(
        TINY,
        [
            *FIXED,
            "parallel.tp=2",
            "launch.nproc_per_node=8",
            "train.lr=1e-4",
            "parallel.zero_1=true",
            "hub.repo_id=alice/x",
        ],
    )
    assert cfg.parallel.tp == 2 and cfg.train.lr == 1e-4 and cfg.parallel.zero_1 is True
    assert not cfg.parallel.is_auto
    assert cfg.dp == 4 and cfg.parallel_config().dp == 4 and cfg.global_batch_size == 8 * 4
    assert cfg.hub.repo_id == "alice/x"
    partial = FinetuneConfig.load(TINY, ["parallel.tp=2", "parallel.zero_1=true"])
    assert partial.parallel.fixed() == {"tp": 2, "zero_1": True}


def test_global_batch_size_must_agree_with_a_fixed_layout():
    assert FinetuneConfig.load(TINY, [*FIXED, "train.global_batch_size=16"]).global_batch_size == 16
    with pytest.raises(ValueError, match=r"global_batch_size=12 but micro_batch_size × grad_accum × dp = 8 × 1 × 2"):
        FinetuneConfig.load(TINY, [*FIXED, "train.global_batch_size=12"])


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
    assert "world size 4" in msg and "tp × pp = 3 × 1 = 3" in msg and "tp=2, pp=1" in msg


def test_bad_values_are_reported_with_their_key():
    with pytest.raises(ValueError, match="train.lr"):
        FinetuneConfig.load(TINY, ["train.lr=-1"])
    with pytest.raises(ValueError, match="sequence_parallel needs parallel.tp > 1"):
        FinetuneConfig.load(TINY, ["parallel.tp=1", "parallel.sequence_parallel=true"])
    with pytest.raises(ValueError, match="sequence_parallel needs parallel.tp > 1"):
        FinetuneConfig.load(TINY, [*FIXED, "parallel.sequence_parallel=true"])
    with pytest.raises(ValueError, match="--set"):
        FinetuneConfig.load(TINY, ["parallel.tp"])


def test_job_round_trips_through_json(tmp_path):
    cfg = FinetuneConfig.load(TINY, [*FIXED, "parallel.pp=2", "parallel.num_microbatches=2"])
    job = cfg.to_job(model_path="m", dataset_path="d")
    assert job.parallel == ParallelConfig(pp=2, dp=1, num_microbatches=2)
    (tmp_path / "job.json").write_text(job.to_json())
    assert JobConfig.load(tmp_path / "job.json") == job
    assert job.global_batch_size == cfg.train.micro_batch_size * cfg.train.grad_accum * cfg.dp


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
