"""The one user-facing configuration: YAML files, ``--set`` overrides and the Prefect UI form
are all this pydantic model. ``FinetuneConfig.to_job`` is the one place it becomes the
library's dataclasses."""

from __future__ import annotations

import dataclasses
import difflib
import os
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from neuron_parallel.config import JobConfig, LaunchConfig, ParallelConfig, TrainConfig
from neuron_parallel.plan import Plan, check_plan

AUTO = "auto"
Auto = Literal["auto"]
Positive = Annotated[int, Field(ge=1)]
NonNegative = Annotated[int, Field(ge=0)]
DEVICE_HARDWARE = {"cpu": "cpu", "cuda": "p5.48xlarge", "neuron": "trn2.48xlarge"}


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
    """Every field but ``layer_split`` and ``mixed_precision`` may be ``auto``: the plan step then
    asks the planner (``neuron_parallel.planner``) for the fastest layout that fits, keeping the
    fields that are set."""

    tp: Positive | Auto = Field(AUTO, description="Tensor-parallel degree.")
    pp: Positive | Auto = Field(AUTO, description="Pipeline-parallel degree.")
    zero_1: bool | Auto = Field(AUTO, description="Shard optimizer state over data-parallel ranks (ZeRO-1).")
    sequence_parallel: bool | Auto = Field(AUTO, description="Sequence parallelism in norms (needs tp > 1).")
    num_microbatches: Positive | Auto = Field(AUTO, description="Pipeline microbatches per micro-batch (pp > 1).")
    pipeline_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "zbv", "auto"] = AUTO
    virtual_stages: Positive | Auto = Field(AUTO, description="Model chunks per pipeline rank (interleaved schedules).")
    layer_split: list[int] | None = Field(
        None, description="Decoder layers per stage; default even (needs a fixed pp)."
    )
    activation_checkpointing: NonNegative | Auto = Field(AUTO, description="Recompute every k-th layer; 0 = off.")
    mixed_precision: Literal["fp32", "bf16"] = "fp32"

    def fixed(self) -> dict[str, Any]:
        """The layout fields that are set (not ``auto``)."""
        names = (
            "tp",
            "pp",
            "zero_1",
            "sequence_parallel",
            "num_microbatches",
            "pipeline_schedule",
            "virtual_stages",
            "activation_checkpointing",
        )
        fixed = {n: getattr(self, n) for n in names if getattr(self, n) != AUTO}
        if self.layer_split is not None and self.pp != AUTO and self.virtual_stages == AUTO:
            fixed["virtual_stages"] = max(1, len(self.layer_split) // self.pp)  # one count per stage
        return fixed

    @property
    def is_auto(self) -> bool:
        return AUTO in (
            self.tp,
            self.pp,
            self.zero_1,
            self.sequence_parallel,
            self.num_microbatches,
            self.pipeline_schedule,
            self.virtual_stages,
            self.activation_checkpointing,
        )


class TrainSection(_Section):
    max_steps: int = Field(100, ge=1)
    save_every: int = Field(50, ge=0, description="Checkpoint every N steps (and at the end).")
    keep_checkpoints: int = Field(3, ge=0, description="Keep the newest K complete checkpoints; 0 = all.")
    async_save: bool = Field(
        False, description="Write checkpoints in the background; training waits only for the host copy."
    )
    seed: int = 0
    micro_batch_size: int = Field(
        4,
        ge=1,
        description="Sequences per data-parallel rank per micro-batch (chosen by the planner when the layout is auto).",
    )
    grad_accum: int = Field(
        1, ge=1, description="Micro-batches per optimizer step (chosen by the planner when the layout is auto)."
    )
    global_batch_size: int | None = Field(
        None,
        ge=1,
        description="Sequences per optimizer step. Default "
        "micro_batch_size × grad_accum × data-parallel ranks; with an auto "
        "layout, micro_batch_size × grad_accum × all ranks.",
    )
    lr: float = Field(1e-3, gt=0)
    warmup_steps: int = Field(0, ge=0)
    lr_schedule: Literal["cosine", "constant"] = "cosine"
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    weight_decay: float = Field(0.0, ge=0)
    max_grad_norm: float = Field(1.0, ge=0)
    optimizer: Literal["adamw", "sgd"] = "adamw"
    log_every: int = Field(1, ge=1)
    resume_from: str | None = Field(None, description="Continue another run's directory or checkpoint.")
    profile_memory: bool = Field(
        False,
        description="Measure peak tensor memory per rank against the plan's "
        "prediction (memory.json; slower steps on CPU).",
    )


class LaunchSection(_Section):
    device: Literal["cpu", "cuda", "neuron"] = Field("cpu", description="cpu (gloo), cuda (nccl), neuron (neuron).")
    nproc_per_node: int = Field(1, ge=1, description="Ranks per node (64 on trn2.48xlarge).")
    nnodes: int = Field(1, ge=1)
    rdzv_endpoint: str | None = Field(
        None, description="host:port of the c10d rendezvous for multi-node runs (default $NEURON_FLOWS_RDZV_ENDPOINT)."
    )
    rdzv_id: str = "neuron-flows"
    omp_num_threads: int = Field(1, ge=1, description="OMP threads per rank.")
    retries: int = Field(
        1,
        ge=0,
        description="Automatic retries of the train step within a run; each resumes "
        "from the newest complete checkpoint.",
    )
    hardware: str | None = Field(
        None,
        description="Hardware kind the planner plans for (neuron_parallel.hardware "
        "catalog or a YAML file); default from device: cpu → cpu, cuda → p5.48xlarge, "
        "neuron → trn2.48xlarge.",
    )


class OutputSection(_Section):
    dir: str = Field(
        ".runs/{flow_run_name}",
        description="Run directory: metrics, checkpoints, consolidated model. "
        "{flow_run_name} and {flow_run_id} become the Prefect flow run's, so every run has its own "
        "directory and a retry of a run continues in it.",
    )
    consolidated_dir: str | None = Field(None, description="Default: <output.dir>/consolidated.")
    format: Literal["safetensors", "pytorch"] = "safetensors"
    max_shard_size: str = "5GB"


class HubSection(_Section):
    repo_id: str | None = Field(None, description="Hub repo to upload to; empty skips the upload.")
    endpoint: str | None = Field(None, description="Hub URL; default the public Hub (or HF_ENDPOINT).")
    private: bool = True
    token_secret: str | None = Field(
        None, description="Name of a Prefect Secret block holding the token; else HF_TOKEN."
    )


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
    def _check_split(self) -> FinetuneConfig:
        """What can be checked without the model: raises ValueError naming the fix."""
        par, world = self.parallel, self.world_size
        if not par.is_auto:
            self.parallel_config()
            if self.train.global_batch_size not in (None, self._fixed_global_batch()):
                raise ValueError(
                    f"train.global_batch_size={self.train.global_batch_size} but micro_batch_size × grad_accum × dp = "
                    f"{self.train.micro_batch_size} × {self.train.grad_accum} × {self.dp} = {self._fixed_global_batch()}; "
                    "drop one of them, or set the layout to auto and let the planner split the batch"
                )
            return self
        tp, pp = (v if v != AUTO else 1 for v in (par.tp, par.pp))
        if world % (tp * pp):
            ParallelConfig.for_world(world, tp=tp, pp=pp)  # raises, listing the splits that divide
        if par.sequence_parallel is True and par.tp == 1:
            raise ValueError(
                "parallel.sequence_parallel needs parallel.tp > 1; set sequence_parallel=false or raise tp"
            )
        if par.layer_split is not None and par.pp == AUTO:
            raise ValueError(
                "parallel.layer_split needs a fixed parallel.pp (one layer count per stage); set pp or drop layer_split"
            )
        if par.pipeline_schedule == "zbv":
            raise ValueError(
                "the planner does not model pipeline_schedule=zbv; with zbv give the whole layout "
                "(tp, pp, zero_1, sequence_parallel, num_microbatches, virtual_stages=2, "
                "activation_checkpointing), or choose another schedule"
            )
        return self

    @property
    def world_size(self) -> int:
        return self.launch.nproc_per_node * self.launch.nnodes

    @property
    def dp(self) -> int:
        """Data-parallel degree of a fixed layout."""
        return self.parallel_config().dp

    def _fixed_global_batch(self) -> int:
        return self.train.micro_batch_size * self.train.grad_accum * self.dp

    @property
    def global_batch_size(self) -> int:
        """Sequences per optimizer step (see ``train.global_batch_size``)."""
        if self.train.global_batch_size:
            return self.train.global_batch_size
        if self.parallel.is_auto:
            return self.train.micro_batch_size * self.train.grad_accum * self.world_size
        return self._fixed_global_batch()

    @property
    def hardware(self) -> str:
        return self.launch.hardware or DEVICE_HARDWARE[self.launch.device]

    def for_run(self, name: str, run_id: str) -> FinetuneConfig:
        """This config with ``{flow_run_name}`` and ``{flow_run_id}`` in the output paths filled in."""
        out = self.output.model_copy()
        for key in ("dir", "consolidated_dir"):
            value = getattr(out, key)
            if value:
                setattr(out, key, value.replace("{flow_run_name}", name).replace("{flow_run_id}", run_id))
        return self.model_copy(update={"output": out})

    @property
    def consolidated_path(self) -> str:
        return self.output.consolidated_dir or str(Path(self.output.dir) / "consolidated")

    def parallel_config(self) -> ParallelConfig:
        """The layout as given; an auto layout is resolved by ``resolve_layout``."""
        if self.parallel.is_auto:
            raise ValueError("the parallel layout has auto fields; resolve it with resolve_layout(config, model_dir)")
        return ParallelConfig.for_world(self.world_size, **self.parallel.model_dump())

    def to_job(self, *, model_path: str, dataset_path: str, plan: Plan | None = None) -> JobConfig:
        """The library's view of this run, given the resolved model and dataset locations and,
        for an auto layout, the plan that resolved it."""
        train = self.train.model_dump()
        resume_from = train.pop("resume_from")
        train.pop("global_batch_size")
        if plan is not None:
            parallel = plan.parallel
            train.update(micro_batch_size=plan.micro_batch_size, grad_accum=plan.grad_accum)
        else:
            parallel = self.parallel_config()
        return JobConfig(
            model_path=model_path,
            dataset_path=dataset_path,
            output_dir=self.output.dir,
            block_size=self.data.block_size,
            device=self.launch.device,
            parallel=parallel,
            train=TrainConfig(**train),
            resume_from=resume_from,
        )

    def to_launch(self) -> LaunchConfig:
        return LaunchConfig(
            nproc_per_node=self.launch.nproc_per_node,
            nnodes=self.launch.nnodes,
            # On Kubernetes the first pod's stable name comes from the environment (deployments/trn2).
            rdzv_endpoint=self.launch.rdzv_endpoint or os.environ.get("NEURON_FLOWS_RDZV_ENDPOINT"),
            rdzv_id=self.launch.rdzv_id,
            omp_num_threads=self.launch.omp_num_threads,
        )

    @classmethod
    def load(cls, path: str | Path | None = None, overrides: list[str] | None = None) -> FinetuneConfig:
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


def resolve_layout(config: FinetuneConfig, model_dir: str, dataset_path: str = ""):
    """The layout this run trains with, checked against the model: ``(Plan, PlanReport | None)``.

    A fixed layout is checked as given. An auto one goes to the planner with the fields that are
    set pinned, the run's world (``launch``), hardware kind, sequence length, global batch and
    precision; the fastest layout that fits wins, and the report (every candidate, with the
    reason for each rejection) comes back for display. Raises ``ValueError`` with the planner's
    reason when nothing fits."""
    from neuron_parallel.planner import plan as plan_layouts

    if not config.parallel.is_auto:
        return check_plan(config.to_job(model_path=model_dir, dataset_path=dataset_path)), None
    precision = "fp32" if config.parallel.mixed_precision == "fp32" else "bf16_autocast"
    report = plan_layouts(
        Path(model_dir) / "config.json",
        config.hardware,
        nodes=config.launch.nnodes,
        seq_len=config.data.block_size,
        global_batch=config.global_batch_size,
        precision=precision,
        ranks_per_node=config.launch.nproc_per_node,
        fixed=config.parallel.fixed(),
    )
    best = report.best
    if best is None:
        raise ValueError(f"no parallel layout fits: {report.reason}")
    pc = dataclasses.replace(
        best.to_parallel_config(),
        mixed_precision=config.parallel.mixed_precision,
        layer_split=config.parallel.layer_split,
    )  # replace() re-runs the checks
    resolved = Plan(
        parallel=pc,
        world_size=pc.world_size,
        global_batch_size=config.global_batch_size,
        num_parameters=report.model.num_parameters,
        layers_per_stage=[],
        micro_batch_size=best.micro_batch_size,
        grad_accum=best.grad_accum,
    )
    checked = check_plan(config.to_job(model_path=model_dir, dataset_path=dataset_path, plan=resolved))
    return dataclasses.replace(
        checked,
        predicted_memory_bytes=best.memory_per_rank_bytes,
        predicted_tokens_per_s=best.tokens_per_s,
        notes=checked.notes + [f"chosen by the planner for {config.hardware}: {best.describe()}"],
    ), report
