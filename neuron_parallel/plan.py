"""Checking a parallel layout against the model and the batch before anything is launched."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .config import JobConfig, ParallelConfig
from .models.causal_lm import load_config, split_layers


@dataclass(frozen=True, slots=True)
class Plan:
    """A layout that was checked against the model: what the train step will run."""

    parallel: ParallelConfig
    world_size: int
    global_batch_size: int
    num_parameters: int
    layers_per_stage: list[int]
    micro_batch_size: int = 1
    """Sequences per dp rank per forward/backward (``train.micro_batch_size``)."""
    grad_accum: int = 1
    notes: list[str] = field(default_factory=list)
    predicted_memory_bytes: int | None = None
    """The planner's memory per rank (worst rank, with its allocator margin), when it chose this."""
    predicted_tokens_per_s: float | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def count_parameters(config) -> int:
    """Parameters of a Llama-family model from its config alone."""
    h, v, L = config.hidden_size, config.vocab_size, config.num_hidden_layers
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    hd = getattr(config, "head_dim", None) or h // heads
    attn = h * heads * hd * 2 + h * kv * hd * 2
    mlp = 3 * h * config.intermediate_size
    per_layer = attn + mlp + 2 * h
    embed = v * h * (1 if config.tie_word_embeddings else 2)
    return L * per_layer + embed + h


def check_plan(job: JobConfig) -> Plan:
    """Validate ``job.parallel`` against the model at ``job.model_path`` and the batch; raises
    ``ValueError`` naming the numbers at fault and a valid alternative."""
    pc = job.parallel
    config = load_config(job.model_path)
    heads, kv, layers = config.num_attention_heads, config.num_key_value_heads, config.num_hidden_layers
    if heads % pc.tp:
        ok = [t for t in _divisors(heads) if t <= pc.world_size]
        raise ValueError(f"tp={pc.tp} does not divide the model's {heads} attention heads; use tp in {ok}")
    if pc.tp > kv and pc.tp % kv:
        raise ValueError(
            f"tp={pc.tp} exceeds the model's {kv} KV heads and is not a multiple of it, so KV heads cannot be "
            f"replicated evenly; use tp dividing {kv} or a multiple of {kv}"
        )
    if kv > pc.tp and kv % pc.tp:
        raise ValueError(f"tp={pc.tp} does not divide the model's {kv} KV heads; use tp in {_divisors(kv)}")
    split = split_layers(layers, pc.num_stages, pc.layer_split)
    if pc.pp > 1 and pc.pipeline_schedule in ("1f1b", "interleaved_1f1b") and pc.num_microbatches < pc.pp:
        raise ValueError(
            f"parallel.num_microbatches={pc.num_microbatches} is below pp={pc.pp}; the {pc.pipeline_schedule} "
            f"schedule needs num_microbatches >= pp (e.g. {pc.pp})"
        )
    mbs = job.train.micro_batch_size
    if pc.pp > 1 and mbs % pc.num_microbatches:
        good = [m for m in _divisors(mbs)]
        raise ValueError(
            f"train.micro_batch_size={mbs} is not divisible by parallel.num_microbatches={pc.num_microbatches}; "
            f"use num_microbatches in {good} or a micro_batch_size that is a multiple of {pc.num_microbatches}"
        )
    if pc.sequence_parallel and job.block_size % pc.tp:
        raise ValueError(
            f"sequence parallelism splits the {job.block_size}-token sequence over tp={pc.tp}; "
            f"use a data.block_size divisible by {pc.tp}"
        )
    notes = []
    if pc.tp > kv:
        notes.append(f"KV heads replicated {pc.tp // kv}x (tp={pc.tp} > {kv} KV heads)")
    return Plan(
        parallel=pc,
        world_size=pc.world_size,
        global_batch_size=job.global_batch_size,
        num_parameters=count_parameters(config),
        layers_per_stage=[len(r) for r in split],
        micro_batch_size=mbs,
        grad_accum=job.train.grad_accum,
        notes=notes,
    )
