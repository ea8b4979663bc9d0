"""The configuration of a training run: one definition of every field, with its docstring.

These dataclasses (with ``DataConfig``, defined in ``neuron_parallel.data_config`` for its size and
re-exported here) are the whole vocabulary. The Prefect/CLI boundary
(``neuron_flows.tasks.config.FinetuneConfig``) is built from them field by field and adds only
what is its own (``auto`` for the planned fields, output paths, the Hub, retries, hardware).
Each ``__post_init__`` checks the values and raises ``ValueError`` naming the values at fault
and a valid alternative.

The global batch follows one rule: ``train.global_batch_size`` sequences per optimizer step,
whatever the layout and the number of ranks. Each data-parallel rank runs
``train.micro_batch_size`` sequences per forward/backward, and gradient accumulation makes up
the rest: ``grad_accum = global_batch_size / (micro_batch_size × dp)``.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from .data_config import DataConfig
from .utils import check_choice, check_context_split, divisors

PipelineSchedule = Literal["gpipe", "1f1b", "interleaved_1f1b", "zbv"]
Precision = Literal["auto", "fp32", "bf16"]
Optimizer = Literal["adamw", "sgd"]
LrSchedule = Literal["cosine", "constant"]
Device = Literal["cpu", "cuda", "neuron"]
ReportTo = Literal["tensorboard", "mlflow"]
PIPELINE_SCHEDULES = get_args(PipelineSchedule)
PRECISIONS = get_args(Precision)
AUTO_PRECISION = {"cpu": "fp32", "cuda": "bf16", "neuron": "bf16"}
"""What ``parallel.mixed_precision: auto`` runs, by device: bf16 autocast with fp32 master
weights on the accelerators, whose matmul units are fastest in bf16; fp32 on CPU."""
OPTIMIZERS = get_args(Optimizer)

LAYOUT_FIELDS = (
    "tp",
    "pp",
    "cp",
    "zero_1",
    "sequence_parallel",
    "num_microbatches",
    "pipeline_schedule",
    "virtual_stages",
    "activation_checkpointing",
)
"""The ``ParallelConfig`` fields the planner chooses when they are left ``auto``."""
PLANNED_FIELDS = {"parallel": LAYOUT_FIELDS, "train": ("micro_batch_size",)}
"""Every field the planner may choose, by section: the layout and the micro batch."""


def _check_choice(section: str, name: str, value: Any, kind: Any) -> None:
    check_choice(section, name, value, get_args(kind))


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """The model to fine-tune."""

    name_or_path: str = ".tiny/model"
    """A local Hugging Face model directory or a Hub model id."""
    revision: str | None = None
    """Hub revision when name_or_path is a Hub id."""


Objective = Literal["sft", "dpo", "simpo", "orpo"]
DpoLossType = Literal["sigmoid", "ipo", "hinge", "robust"]


@dataclass(kw_only=True, slots=True)
class ParallelConfig:
    """How the model and the batch are split across ranks."""

    tp: int = 1
    """Tensor-parallel degree (innermost mesh axis)."""
    sequence_parallel: bool = False
    """Shard activations along the sequence in norms and residuals (needs tp > 1)."""
    pp: int = 1
    """Pipeline-parallel degree: number of pipeline ranks."""
    pipeline_schedule: PipelineSchedule = "1f1b"
    """Pipeline schedule: gpipe, 1f1b, interleaved_1f1b or zbv (zero-bubble V)."""
    num_microbatches: int = 1
    """Pipeline microbatches per micro-batch step; the per-rank batch must divide by it."""
    virtual_stages: int = 1
    """Model chunks per pipeline rank (interleaved_1f1b and zbv need 2 or more)."""
    layer_split: list[int] | None = None
    """Decoder layers per pipeline stage, e.g. [3, 5]; None splits evenly."""
    cp: int = 1
    """Context-parallel degree: every row's sequence split into ``cp`` shards across a cp mesh
    axis (between dp and pp), attention exchanging K/V across them."""
    dp: int = 1
    """Data-parallel degree; derived from the world size by ``ParallelConfig.for_world``."""
    zero_1: bool = False
    """Shard the optimizer state (AdamW's moments, SGD's momentum) across dp ranks (ZeRO-1); the
    fp32 parameters, also the master weights under bf16, stay whole on every dp rank."""
    activation_checkpointing: int = 0
    """Recompute every k-th decoder layer in backward; 0 disables, 1 recomputes every layer."""
    mixed_precision: Precision = "auto"
    """auto (bf16 on cuda and neuron, fp32 on cpu, resolved from launch.device when the job is
    built), fp32, or bf16: bf16 autocast compute with fp32 master weights."""

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "cp", "dp", "num_microbatches", "virtual_stages"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"parallel.{name} must be an integer >= 1, got {value!r}")
        _check_choice("parallel", "pipeline_schedule", self.pipeline_schedule, PipelineSchedule)
        _check_choice("parallel", "mixed_precision", self.mixed_precision, Precision)
        if self.sequence_parallel and self.tp == 1:
            raise ValueError(
                "parallel.sequence_parallel needs parallel.tp > 1; set sequence_parallel=false or raise tp"
            )
        multi = self.pipeline_schedule in ("interleaved_1f1b", "zbv")
        if multi and self.virtual_stages < 2:
            raise ValueError(
                f"parallel.pipeline_schedule={self.pipeline_schedule} needs parallel.virtual_stages >= 2 "
                f"(got {self.virtual_stages}); use 1f1b for one stage per rank"
            )
        if not multi and self.virtual_stages != 1:
            raise ValueError(
                f"parallel.virtual_stages={self.virtual_stages} needs pipeline_schedule interleaved_1f1b or zbv"
            )
        if self.pipeline_schedule == "zbv" and self.virtual_stages != 2:
            raise ValueError("parallel.pipeline_schedule=zbv uses exactly 2 virtual stages per rank")
        if self.activation_checkpointing < 0:
            raise ValueError("parallel.activation_checkpointing must be 0 (off) or k >= 1 (every k-th layer)")
        if self.layer_split is not None and len(self.layer_split) != self.num_stages:
            raise ValueError(
                f"parallel.layer_split has {len(self.layer_split)} entries but pp × virtual_stages = "
                f"{self.num_stages} stages; give one layer count per stage"
            )

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.pp * self.tp

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual_stages

    @classmethod
    def for_world(cls, world_size: int, **kwargs: Any) -> ParallelConfig:
        """Derive dp = world_size / (cp × tp × pp), refusing splits that do not divide."""
        tp, pp, cp = kwargs.get("tp", 1), kwargs.get("pp", 1), kwargs.get("cp", 1)
        if world_size % (tp * pp * cp):
            fits = [f"tp={t}, pp={p}" for t in divisors(world_size) for p in divisors(world_size // t)][:6]
            raise ValueError(
                f"world size {world_size} (launch.nproc_per_node × launch.nnodes) is not divisible by "
                f"cp × tp × pp = {cp} × {tp} × {pp} = {cp * tp * pp}; choose cp × tp × pp dividing {world_size} "
                f"(e.g. {'; '.join(fits)}) or change launch.nproc_per_node"
            )
        kwargs["dp"] = world_size // (tp * pp * cp)
        return cls(**kwargs)


LORA_TARGETS_DEFAULT = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The attention and MLP projections of the decoder layers: LoRA's default targets."""


@dataclass(kw_only=True, slots=True)
class LoraConfig:
    """Low-rank adapters (LoRA) on frozen base weights: ``W x + (alpha / r) · B A dropout(x)``."""

    r: int = 8
    """Rank of each adapter."""
    alpha: float = 16.0
    """Scale numerator: the adapter's output is multiplied by alpha / r."""
    dropout: float = 0.0
    """Dropout on the adapter's input (training only)."""
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS_DEFAULT))
    """Linear layers of every decoder layer that get an adapter, by name (q_proj … down_proj)."""
    modules_to_save: list[str] = field(default_factory=list)
    """Whole modules trained in full alongside the adapters and saved with them, e.g. lm_head."""

    def __post_init__(self) -> None:
        if self.r < 1:
            raise ValueError(f"train.lora.r must be >= 1, got {self.r}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"train.lora.dropout must be within [0, 1), got {self.dropout}")
        unknown = sorted(set(self.target_modules) - set(LORA_TARGETS_DEFAULT))
        if unknown or not self.target_modules:
            raise ValueError(
                f"train.lora.target_modules {unknown or '[]'} not among the decoder's projections "
                f"{list(LORA_TARGETS_DEFAULT)}; name one or more of those"
            )
        unknown = sorted(set(self.modules_to_save) - {"lm_head", "embed_tokens"})
        if unknown:
            raise ValueError(f"train.lora.modules_to_save {unknown} unknown; use lm_head and/or embed_tokens")


@dataclass(kw_only=True, slots=True)
class PreferenceConfig:
    """Settings of the preference objectives (train.objective dpo, simpo or orpo)."""

    beta: float = 0.1
    """DPO and SimPO: the inverse temperature β of the implicit reward; ORPO: the weight λ of the
    odds-ratio term (as TRL's ORPOConfig names it beta)."""
    loss_type: DpoLossType = "sigmoid"
    """DPO's loss of the reward margin: sigmoid (DPO), ipo (IPO), hinge (SLiC) or robust (robust
    DPO, with label_smoothing as the label noise)."""
    label_smoothing: float = 0.0
    """DPO sigmoid and robust: the assumed probability that a pair's labels are flipped (cDPO);
    SimPO sigmoid: the same smoothing. 0 trusts every label."""
    gamma: float = 0.5
    """SimPO: the target reward margin γ (TRL's cpo_alpha=0, simpo_gamma)."""

    def __post_init__(self) -> None:
        _check_choice("train.preference", "loss_type", self.loss_type, DpoLossType)
        if not self.beta > 0:
            raise ValueError(f"train.preference.beta must be > 0, got {self.beta}")
        if not 0 <= self.label_smoothing < 0.5:
            raise ValueError(f"train.preference.label_smoothing must be within [0, 0.5), got {self.label_smoothing}")


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """Optimisation hyper-parameters and the checkpoint cadence."""

    max_steps: int = 100
    """Optimizer steps to run in total (a resumed run continues up to this)."""
    save_every: int = 50
    """Save a checkpoint every N optimizer steps (and at the last step); 0 saves only at the end."""
    keep_checkpoints: int = 3
    """Keep the newest K complete checkpoints; 0 keeps all."""
    async_save: bool = False
    """Write checkpoints in a background thread; training waits only for the host copy."""
    seed: int = 0
    """Seeds the data order, dropout and the LoRA adapters' initialisation (the model's weights
    are always loaded)."""
    global_batch_size: int = 8
    """Sequences per optimizer step, whatever the layout and the number of ranks (rows of packed
    data; under a preference objective, rows of pairs)."""
    micro_batch_size: int = 4
    """Sequences per data-parallel rank per forward/backward; gradient accumulation makes up the
    rest of the global batch (chosen by the planner when left auto)."""
    lr: float = 1e-3
    """Peak learning rate."""
    warmup_steps: int = 0
    """Linear warm-up steps."""
    lr_schedule: LrSchedule = "cosine"
    """cosine (to min_lr_ratio × lr) or constant after warm-up."""
    min_lr_ratio: float = 0.1
    """Floor of the cosine schedule as a fraction of lr."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping."""
    optimizer: Optimizer = "adamw"
    """adamw, or sgd (exact update, used for parity checks)."""
    log_every: int = 1
    """Print a progress line every N steps (metrics.jsonl gets every step)."""
    eval_every: int = 0
    """Compute the eval loss every N optimizer steps and after the last one (needs eval data:
    data.eval_source, data.eval_split or data.eval_fraction); 0 evaluates only after the last
    step."""
    objective: Objective = "sft"
    """sft (next-token loss on the trained tokens), or a preference objective on data.format=preference:
    dpo (needs a reference: the base with the adapters off under LoRA, else the reference step's
    log-probabilities), simpo or orpo; settings in train.preference."""
    preference: PreferenceConfig = field(default_factory=PreferenceConfig)
    """beta, loss_type, label_smoothing and gamma of the preference objectives."""
    lora: LoraConfig | None = None
    """Train low-rank adapters on the frozen base model instead of every weight; None (the
    default) fine-tunes every weight."""
    early_stopping_patience: int = 0
    """End training, with a final checkpoint, after this many evals in a row without a lower eval
    loss; 0 never stops early."""
    resume_from: str | None = None
    """Another run directory (or one of its checkpoints) to continue from when the run directory
    has no checkpoint of its own."""
    compile: bool = False
    """Compile each decoder layer with torch.compile (backend inductor on cuda and cpu, neuron on
    neuron), once tensor parallelism and activation checkpointing are in place; the first steps
    are slower while the graphs compile (on neuron every new input shape compiles a graph)."""
    profile_memory: bool = False
    """Measure every rank's peak tensor memory over the training steps (checkpoint writes
    excluded) and report it next to the planner's prediction (``memory.json``, a ``memory``
    event). On CPU through the profiler (``neuron_parallel.memprof``: slower steps), on
    accelerators from the device allocator's statistics."""
    report_to: list[ReportTo] = field(default_factory=lambda: ["tensorboard"])
    """Trackers rank 0 also sends every step's metrics to (metrics.jsonl is always written):
    tensorboard (event files in <run dir>/tensorboard), mlflow (the run in MLFLOW_TRACKING_URI,
    else in <run dir>/mlflow.db; needs the mlflow extra); an empty list sends them nowhere else."""

    def __post_init__(self) -> None:
        self.report_to = [self.report_to] if isinstance(self.report_to, str) else list(self.report_to)
        unknown = [name for name in self.report_to if name not in get_args(ReportTo)]
        if unknown:
            raise ValueError(
                f"train.report_to has {unknown}, not among {list(get_args(ReportTo))}; "
                "list some of those, or none ([]) to write metrics.jsonl only"
            )
        for name in ("max_steps", "global_batch_size", "micro_batch_size", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("save_every", "keep_checkpoints", "warmup_steps", "eval_every", "early_stopping_patience"):
            if getattr(self, name) < 0:
                raise ValueError(f"train.{name} must be >= 0, got {getattr(self, name)}")
        if self.lr <= 0:
            raise ValueError(f"train.lr must be > 0, got {self.lr}")
        _check_choice("train", "optimizer", self.optimizer, Optimizer)
        _check_choice("train", "lr_schedule", self.lr_schedule, LrSchedule)
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"train.min_lr_ratio must be within [0, 1], got {self.min_lr_ratio}")
        if self.weight_decay < 0 or self.max_grad_norm < 0:
            raise ValueError("train.weight_decay and train.max_grad_norm must be >= 0 (0 disables clipping)")
        if self.global_batch_size % self.micro_batch_size:
            raise ValueError(
                f"train.global_batch_size={self.global_batch_size} is not a multiple of "
                f"train.micro_batch_size={self.micro_batch_size}; use a micro batch in "
                f"{divisors(self.global_batch_size)}"
            )
        if self.early_stopping_patience and not self.eval_every:
            raise ValueError(
                "train.early_stopping_patience needs train.eval_every > 0: evals happen only after the last step "
                "otherwise; set eval_every or drop early_stopping_patience"
            )
        self.betas = tuple(self.betas)
        _check_choice("train", "objective", self.objective, Objective)
        if isinstance(self.preference, dict):
            self.preference = PreferenceConfig(**self.preference)
        if isinstance(self.lora, dict):
            self.lora = LoraConfig(**self.lora)


@dataclass(kw_only=True, slots=True)
class LaunchConfig:
    """How torchrun is started on this node."""

    device: Device = "cpu"
    """cpu, cuda or neuron; the torch.distributed backend follows from it (gloo, nccl, neuron)."""
    nproc_per_node: int = 1
    """Ranks on this node (64 on trn2.48xlarge)."""
    nnodes: int = 1
    """Nodes in the job; above 1 a c10d rendezvous at ``rdzv_endpoint`` joins them."""
    rdzv_endpoint: str | None = None
    """host:port reachable from every node (the first node's address, typically)."""
    rdzv_id: str = "neuron-flows"
    """Rendezvous id shared by every node of one job."""
    omp_num_threads: int = 1
    """OMP threads per rank."""
    memory_fraction: float = 0.9
    """Share of each rank's device memory a planned layout may fill: the planner accepts a layout
    only if its predicted peak per rank is at most this × the hardware's memory per rank; the rest
    is headroom for what the prediction misses."""
    timeout_s: float = 1800.0
    """Seconds a collective may wait for another rank before the job fails: a rank that hangs or
    dies ends the run within this time (then retry: it resumes from the last complete checkpoint)
    instead of holding every other rank. It also bounds rank 0's wait for the other ranks' parts
    of a checkpoint, so it must exceed the longest step, evaluation or checkpoint write."""
    first_step_timeout_s: float | None = None
    """Seconds a collective may wait for another rank until each start's first optimizer step is
    done (building the model, loading a checkpoint, the first step), when ranks compile their
    graphs at different speeds: on neuron every graph of a cold compile cache takes minutes. Then
    launch.timeout_s applies. None: launch.timeout_s throughout."""

    def __post_init__(self) -> None:
        _check_choice("launch", "device", self.device, Device)
        if not self.timeout_s > 0:
            raise ValueError(
                f"launch.timeout_s must be > 0, got {self.timeout_s}; it is how many seconds a collective waits "
                "for another rank, e.g. 1800 (the default) or 600"
            )
        if self.first_step_timeout_s is not None and not self.first_step_timeout_s > 0:
            raise ValueError(
                f"launch.first_step_timeout_s must be > 0 or unset (launch.timeout_s throughout), got "
                f"{self.first_step_timeout_s}; it is how many seconds a collective waits for another rank until the "
                "first step is done, e.g. 5400 where graphs compile on a cold cache"
            )
        if self.omp_num_threads < 1:
            raise ValueError(f"launch.omp_num_threads must be >= 1, got {self.omp_num_threads}")
        if not 0 < self.memory_fraction <= 1:
            raise ValueError(
                f"launch.memory_fraction must lie in (0, 1], got {self.memory_fraction}; it is the share of each "
                "rank's memory a layout may fill, e.g. 0.9 (the default) keeps 10% free, 1.0 uses it all"
            )
        if self.nproc_per_node < 1 or self.nnodes < 1:
            raise ValueError(
                f"launch.nproc_per_node and launch.nnodes must be >= 1, got {self.nproc_per_node}, {self.nnodes}"
            )
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ValueError(
                f"launch.nnodes={self.nnodes} needs launch.rdzv_endpoint=HOST:PORT, an address of the first node "
                "that every node can reach"
            )

    @property
    def start_timeout_s(self) -> float:
        """How long a collective waits for another rank until the first step is done
        (``first_step_timeout_s``, else ``timeout_s``)."""
        return self.timeout_s if self.first_step_timeout_s is None else self.first_step_timeout_s


def resolve_precision(precision: str, device: str) -> str:
    """The precision a job on ``device`` runs for ``parallel.mixed_precision=precision``: ``auto``
    as :data:`AUTO_PRECISION` says, fp32 and bf16 as given."""
    _check_choice("parallel", "mixed_precision", precision, Precision)
    return AUTO_PRECISION[device] if precision == "auto" else precision


def check_objective(data: DataConfig, train: TrainConfig) -> None:
    """Refuse a preference objective without preference data, and preference data under sft."""
    if (train.objective != "sft") != (data.format == "preference"):
        raise ValueError(
            f"train.objective={train.objective} does not go with data.format={data.format}: the preference "
            "objectives (dpo, simpo, orpo) train on data.format: preference and sft on the other formats; set both"
        )


def check_eval(data: DataConfig, train: TrainConfig) -> None:
    """Refuse evaluation settings of ``train`` that the ``data`` section gives no eval rows for."""
    if train.eval_every and not data.has_eval:
        raise ValueError(
            f"train.eval_every={train.eval_every} needs evaluation data; set data.eval_fraction (e.g. 0.05), "
            "data.eval_split (e.g. validation) or data.eval_source, or set train.eval_every=0"
        )


@dataclass(kw_only=True, slots=True)
class JobConfig:
    """Everything one training run needs; written to ``output_dir/job.json`` for the ranks."""

    model_path: str
    """The resolved local Hugging Face model directory (config, safetensors, tokenizer)."""
    dataset_path: str
    """A tokenized, packed dataset in ``datasets.Dataset.save_to_disk``'s layout (``data.save_rows``)."""
    output_dir: str
    """The run directory: metrics.jsonl and checkpoint-<step>/ folders."""
    eval_dataset_path: str | None = None
    """Tokenized eval rows (same format as ``dataset_path``), or None for no eval loss."""
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    reference_path: str | None = None
    """The reference log-probabilities of every pair (``neuron_parallel.preference.compute_reference``):
    a folder with ``train`` (and ``eval``) aligned with the rows; needed by dpo without LoRA."""
    lineage: dict[str, Any] = field(default_factory=dict)
    """What the run trains on by identity (``neuron_parallel.lineage.run_lineage``): stored in every
    checkpoint's trainer state and checked when a run resumes; empty: not recorded or checked."""

    def __post_init__(self) -> None:
        check_objective(self.data, self.train)
        pc = self.parallel
        check_context_split(self.data.block_size, pc.cp, pc.tp, pc.sequence_parallel)
        if self.parallel.mixed_precision == "auto":  # the job records what it runs
            precision = resolve_precision("auto", self.launch.device)
            self.parallel = dataclasses.replace(self.parallel, mixed_precision=precision)
        per_step = self.train.micro_batch_size * self.parallel.dp
        if self.train.global_batch_size % per_step:
            gbs = self.train.global_batch_size
            fits = [m for m in divisors(gbs) if (gbs // m) % self.parallel.dp == 0]
            raise ValueError(
                f"train.global_batch_size={gbs} is not a multiple of train.micro_batch_size × dp = "
                f"{self.train.micro_batch_size} × {self.parallel.dp}; use micro_batch_size in {fits}, "
                f"a global batch that is a multiple of {per_step}, or micro_batch_size=auto"
            )

    @property
    def device(self) -> str:
        return self.launch.device

    @property
    def block_size(self) -> int:
        return self.data.block_size

    @property
    def global_batch_size(self) -> int:
        return self.train.global_batch_size

    @property
    def grad_accum(self) -> int:
        """Micro-batches per optimizer step on each data-parallel rank (see the module docstring)."""
        return self.train.global_batch_size // (self.train.micro_batch_size * self.parallel.dp)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> JobConfig:
        data = dict(data)
        for name, kind in (
            ("data", DataConfig),
            ("parallel", ParallelConfig),
            ("train", TrainConfig),
            ("launch", LaunchConfig),
        ):
            data[name] = kind(**data.get(name, {}))
        return cls(**data)

    @classmethod
    def load(cls, path: str | Path) -> JobConfig:
        return cls.from_dict(json.loads(Path(path).read_text()))
