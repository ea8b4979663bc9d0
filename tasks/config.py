"""The one user-facing configuration: YAML files, ``--set`` overrides and the Prefect UI form
are all this pydantic model. ``FinetuneConfig.to_job`` is the one place it becomes the
library's dataclasses."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from neuron_parallel.config import JobConfig, LaunchConfig, ParallelConfig, TrainConfig


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelSection(_Section):
    name_or_path: str = Field(".tiny/model", description="Local Hugging Face model directory or Hub id.")
    revision: str | None = Field(None, description="Hub revision when name_or_path is a Hub id.")


class DataSection(_Section):
    source: str | list[str] = Field(
        ".tiny/corpus.jsonl", description="Local .txt/.jsonl/.parquet file(s) or folder, or a Hub dataset name."
    )
    text_field: str = Field("text", description="Column holding the text.")
    split: str = Field("train", description="Split to read from a Hub dataset.")
    block_size: int = Field(128, ge=2, description="Tokens per training sequence.")
    cache_dir: str = Field(".runs/datasets", description="Where tokenized datasets are kept, keyed by fingerprint.")


class ParallelSection(_Section):
    tp: int = Field(1, ge=1, description="Tensor-parallel degree.")
    pp: int = Field(1, ge=1, description="Pipeline-parallel degree.")
    zero_1: bool = Field(False, description="Shard optimizer state over data-parallel ranks (ZeRO-1).")
    sequence_parallel: bool = Field(False, description="Sequence parallelism in norms (needs tp > 1).")
    num_microbatches: int = Field(1, ge=1, description="Pipeline microbatches per micro-batch.")
    pipeline_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "zbv"] = "1f1b"
    virtual_stages: int = Field(1, ge=1, description="Model chunks per pipeline rank (interleaved schedules).")
    layer_split: list[int] | None = Field(None, description="Decoder layers per stage; default even.")
    activation_checkpointing: int = Field(0, ge=0, description="Recompute every k-th layer; 0 = off.")
    mixed_precision: Literal["fp32", "bf16"] = "fp32"


class TrainSection(_Section):
    max_steps: int = Field(100, ge=1)
    save_every: int = Field(50, ge=0, description="Checkpoint every N steps (and at the end).")
    keep_checkpoints: int = Field(3, ge=0, description="Keep the newest K complete checkpoints; 0 = all.")
    async_save: bool = Field(False, description="Write checkpoints in the background; training waits only for the host copy.")
    seed: int = 0
    micro_batch_size: int = Field(4, ge=1, description="Sequences per data-parallel rank per micro-batch.")
    grad_accum: int = Field(1, ge=1, description="Micro-batches per optimizer step.")
    lr: float = Field(1e-3, gt=0)
    warmup_steps: int = Field(0, ge=0)
    lr_schedule: Literal["cosine", "constant"] = "cosine"
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    weight_decay: float = Field(0.0, ge=0)
    max_grad_norm: float = Field(1.0, ge=0)
    optimizer: Literal["adamw", "sgd"] = "adamw"
    log_every: int = Field(1, ge=1)
    resume_from: str | None = Field(None, description="Continue another run's directory or checkpoint.")


class LaunchSection(_Section):
    device: Literal["cpu", "cuda", "neuron"] = Field("cpu", description="cpu (gloo), cuda (nccl), neuron (neuron).")
    nproc_per_node: int = Field(1, ge=1, description="Ranks per node (64 on trn2.48xlarge).")
    nnodes: int = Field(1, ge=1)
    rdzv_endpoint: str | None = Field(None, description="host:port of the c10d rendezvous for multi-node runs.")
    rdzv_id: str = "neuron-flows"
    omp_num_threads: int = Field(1, ge=1, description="OMP threads per rank.")


class OutputSection(_Section):
    dir: str = Field(".runs/tiny-llama", description="Run directory: metrics, checkpoints, consolidated model.")
    consolidated_dir: str | None = Field(None, description="Default: <output.dir>/consolidated.")
    format: Literal["safetensors", "pytorch"] = "safetensors"
    max_shard_size: str = "5GB"


class HubSection(_Section):
    repo_id: str | None = Field(None, description="Hub repo to upload to; empty skips the upload.")
    endpoint: str | None = Field(None, description="Hub URL; default the public Hub (or HF_ENDPOINT).")
    private: bool = True
    token_secret: str | None = Field(None, description="Name of a Prefect Secret block holding the token; else HF_TOKEN.")


class FinetuneConfig(_Section):
    """A whole fine-tuning run."""

    model: ModelSection = Field(default_factory=ModelSection)
    data: DataSection = Field(default_factory=DataSection)
    parallel: ParallelSection = Field(default_factory=ParallelSection)
    train: TrainSection = Field(default_factory=TrainSection)
    launch: LaunchSection = Field(default_factory=LaunchSection)
    output: OutputSection = Field(default_factory=OutputSection)
    hub: HubSection = Field(default_factory=HubSection)

    @model_validator(mode="after")
    def _check_split(self) -> "FinetuneConfig":
        self.parallel_config()  # raises ValueError naming the fix
        return self

    @property
    def world_size(self) -> int:
        return self.launch.nproc_per_node * self.launch.nnodes

    @property
    def dp(self) -> int:
        return self.world_size // (self.parallel.tp * self.parallel.pp)

    @property
    def consolidated_path(self) -> str:
        return self.output.consolidated_dir or str(Path(self.output.dir) / "consolidated")

    def parallel_config(self) -> ParallelConfig:
        return ParallelConfig.for_world(self.world_size, **self.parallel.model_dump())

    def to_job(self, *, model_path: str, dataset_path: str) -> JobConfig:
        """The library's view of this run, given the resolved model and dataset locations."""
        train = self.train.model_dump()
        resume_from = train.pop("resume_from")
        return JobConfig(
            model_path=model_path,
            dataset_path=dataset_path,
            output_dir=self.output.dir,
            block_size=self.data.block_size,
            device=self.launch.device,
            parallel=self.parallel_config(),
            train=TrainConfig(**train),
            resume_from=resume_from,
        )

    def to_launch(self) -> LaunchConfig:
        return LaunchConfig(
            nproc_per_node=self.launch.nproc_per_node,
            nnodes=self.launch.nnodes,
            rdzv_endpoint=self.launch.rdzv_endpoint,
            rdzv_id=self.launch.rdzv_id,
            omp_num_threads=self.launch.omp_num_threads,
        )

    @classmethod
    def load(cls, path: str | Path | None = None, overrides: list[str] | None = None) -> "FinetuneConfig":
        """Read a YAML file (or start from defaults) and apply ``dotted.key=value`` overrides."""
        data: dict[str, Any] = {}
        if path is not None:
            p = Path(path)
            if not p.is_file():
                raise ValueError(f"config file {p} does not exist")
            data = yaml.safe_load(p.read_text()) or {}
            if not isinstance(data, dict):
                raise ValueError(f"{p}: the top level must be a mapping of sections, got {type(data).__name__}")
        for item in overrides or []:
            _apply_override(data, item)
        _check_keys(data, cls, "")
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            raise ValueError(_explain(e)) from None


def _apply_override(data: dict[str, Any], item: str) -> None:
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"--set {item!r}: write it as dotted.key=value, e.g. --set parallel.tp=2")
    parts = key.strip().split(".")
    node = data
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ValueError(f"--set {item!r}: {part} is not a section")
    node[parts[-1]] = yaml.safe_load(raw) if raw.strip() else None


def _check_keys(data: Any, model: type[BaseModel], prefix: str) -> None:
    """Unknown keys are an error that lists the valid keys closest to the one given."""
    if not isinstance(data, dict):
        return
    for key, value in data.items():
        field = model.model_fields.get(key)
        if field is None:
            here = sorted(model.model_fields)
            near = difflib.get_close_matches(key, here, n=3, cutoff=0.5)
            hint = f"did you mean {' or '.join(prefix + n for n in near)}? " if near else ""
            raise ValueError(
                f"unknown config key {prefix + key!r}; {hint}valid keys here: {', '.join(prefix + n for n in here)}"
            )
        sub = field.annotation
        if isinstance(sub, type) and issubclass(sub, BaseModel):
            _check_keys(value, sub, f"{prefix}{key}.")


def _explain(e: ValidationError) -> str:
    lines = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        lines.append(f"{loc}: {msg}" if loc else msg)
    return "invalid config: " + "; ".join(lines)
