"""Plain, validated configuration values used inside the library.

The Prefect/CLI boundary (``flows.config.FinetuneConfig``, pydantic) converts into these in one
place; everything in ``neuron_parallel`` takes these dataclasses. Each ``__post_init__`` checks
the numbers and raises ``ValueError`` naming the values at fault and a valid alternative.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zbv")
PRECISIONS = ("fp32", "bf16")
OPTIMIZERS = ("adamw", "sgd")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(kw_only=True, slots=True)
class ParallelConfig:
    """How the model and the batch are split across ranks."""

    tp: int = 1
    """Tensor-parallel degree (innermost mesh axis)."""
    pp: int = 1
    """Pipeline-parallel degree: number of pipeline ranks."""
    dp: int = 1
    """Data-parallel degree; derived from the world size by ``ParallelConfig.for_world``."""
    zero_1: bool = False
    """Shard optimizer state (and fp32 master weights under bf16) across dp ranks."""
    sequence_parallel: bool = False
    """Shard activations along the sequence in norms and residuals (needs tp > 1)."""
    num_microbatches: int = 1
    """Pipeline microbatches per micro-batch step; the per-rank batch must divide by it."""
    pipeline_schedule: str = "1f1b"
    """One of gpipe, 1f1b, interleaved_1f1b, zbv."""
    virtual_stages: int = 1
    """Model chunks per pipeline rank (interleaved_1f1b and zbv need 2 or more)."""
    layer_split: list[int] | None = None
    """Decoder layers per pipeline stage, e.g. [3, 5]; None splits evenly."""
    activation_checkpointing: int = 0
    """Recompute every k-th decoder layer in backward; 0 disables, 1 recomputes every layer."""
    mixed_precision: str = "fp32"
    """fp32, or bf16 compute with fp32 master weights."""

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "num_microbatches", "virtual_stages"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"parallel.{name} must be an integer >= 1, got {value!r}")
        if self.pipeline_schedule not in PIPELINE_SCHEDULES:
            raise ValueError(
                f"parallel.pipeline_schedule={self.pipeline_schedule!r} is not one of {PIPELINE_SCHEDULES}"
            )
        if self.mixed_precision not in PRECISIONS:
            raise ValueError(f"parallel.mixed_precision={self.mixed_precision!r} is not one of {PRECISIONS}")
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
        return self.dp * self.pp * self.tp

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual_stages

    @classmethod
    def for_world(cls, world_size: int, **kwargs: Any) -> ParallelConfig:
        """Derive dp = world_size / (tp × pp), refusing splits that do not divide."""
        tp, pp = kwargs.get("tp", 1), kwargs.get("pp", 1)
        if world_size % (tp * pp):
            fits = [f"tp={t}, pp={p}" for t in _divisors(world_size) for p in _divisors(world_size // t)][:6]
            raise ValueError(
                f"world size {world_size} (launch.nproc_per_node × launch.nnodes) is not divisible by "
                f"tp × pp = {tp} × {pp} = {tp * pp}; choose tp × pp dividing {world_size} "
                f"(e.g. {'; '.join(fits)}) or change launch.nproc_per_node"
            )
        kwargs["dp"] = world_size // (tp * pp)
        return cls(**kwargs)


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
    """Seeds model init (when not loading weights), data order and dropout."""
    micro_batch_size: int = 4
    """Sequences per dp rank per forward/backward."""
    grad_accum: int = 1
    """Micro-batches accumulated per optimizer step."""
    lr: float = 1e-3
    """Peak learning rate."""
    warmup_steps: int = 0
    """Linear warm-up steps."""
    lr_schedule: str = "cosine"
    """cosine (to min_lr_ratio × lr) or constant after warm-up."""
    min_lr_ratio: float = 0.1
    """Floor of the cosine schedule as a fraction of lr."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping."""
    optimizer: str = "adamw"
    """adamw, or sgd (exact update, used for parity checks)."""
    log_every: int = 1
    """Print a progress line every N steps (metrics.jsonl gets every step)."""
    profile_memory: bool = False
    """Measure every rank's peak tensor memory over the training steps (checkpoint writes
    excluded) and report it next to the planner's prediction (``memory.json``, a ``memory``
    event). On CPU through the profiler (``neuron_parallel.memprof``: slower steps), on
    accelerators from the device allocator's statistics."""

    def __post_init__(self) -> None:
        for name in ("max_steps", "micro_batch_size", "grad_accum", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("save_every", "keep_checkpoints", "warmup_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"train.{name} must be >= 0, got {getattr(self, name)}")
        if self.lr <= 0:
            raise ValueError(f"train.lr must be > 0, got {self.lr}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"train.optimizer={self.optimizer!r} is not one of {OPTIMIZERS}")
        if self.lr_schedule not in ("cosine", "constant"):
            raise ValueError(f"train.lr_schedule={self.lr_schedule!r} is not one of ('cosine', 'constant')")
        self.betas = tuple(self.betas)


@dataclass(kw_only=True, slots=True)
class JobConfig:
    """Everything one training run needs; written to ``output_dir/job.json`` for the ranks."""

    model_path: str
    """A local Hugging Face model directory (config, safetensors, tokenizer)."""
    dataset_path: str
    """A tokenized, packed dataset saved with ``datasets.Dataset.save_to_disk``."""
    output_dir: str
    """The run directory: metrics.jsonl and checkpoint-<step>/ folders."""
    block_size: int
    """Tokens per training sequence."""
    device: str = "cpu"
    """cpu, cuda or neuron; the backend follows from it (gloo, nccl, neuron)."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    resume_from: str | None = None
    """Another run directory (or checkpoint) to continue from when output_dir has none."""

    @property
    def global_batch_size(self) -> int:
        """Sequences per optimizer step, whatever the split."""
        return self.train.micro_batch_size * self.train.grad_accum * self.parallel.dp

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> JobConfig:
        data = dict(data)
        data["parallel"] = ParallelConfig(**data.get("parallel", {}))
        data["train"] = TrainConfig(**data.get("train", {}))
        return cls(**data)

    @classmethod
    def load(cls, path: str | Path) -> JobConfig:
        return cls.from_dict(json.loads(Path(path).read_text()))


@dataclass(kw_only=True, slots=True)
class LaunchConfig:
    """How torchrun is started on this node."""

    nproc_per_node: int = 1
    """Ranks on this node."""
    nnodes: int = 1
    """Nodes in the job; above 1 a c10d rendezvous at ``rdzv_endpoint`` joins them."""
    rdzv_endpoint: str | None = None
    """host:port reachable from every node (the first node's address, typically)."""
    rdzv_id: str = "neuron-flows"
    """Rendezvous id shared by every node of one job."""
    omp_num_threads: int = 1
    """OMP threads per rank."""

    def __post_init__(self) -> None:
        if self.nproc_per_node < 1 or self.nnodes < 1:
            raise ValueError(
                f"launch.nproc_per_node and launch.nnodes must be >= 1, got {self.nproc_per_node}, {self.nnodes}"
            )
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ValueError(
                f"launch.nnodes={self.nnodes} needs launch.rdzv_endpoint=HOST:PORT, an address of the first node "
                "that every node can reach"
            )
