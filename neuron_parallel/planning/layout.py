"""Checking one parallel layout against the model and the batch before anything is launched.

The rules that say whether a model can take a layout live here once: ``tp_problems`` (tp against
attention heads, KV heads, MLP width and vocabulary), ``utils.context_problem`` (cp against the row
length) and ``check_layout`` (the whole job; the layers per pipeline stage come from
``neuron_parallel.utils.split_layers``). The config check, the tensor-parallel code and the
layout search all use them. Nothing here imports torch.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..config import JobConfig, ParallelConfig
from ..utils import context_problem, divisors, split_layers
from .attention import block_size_advice
from .memory import ModelShape


@dataclass(frozen=True, slots=True)
class CheckedLayout:
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


def describe_layout(layout, *, micro_batch_size: int | None = None, grad_accum: int | None = None) -> str:
    """A layout in one line, the form the planner's table, the run summary and the model card
    print: ``tp=2 pp=2 dp=1 zero1 sp recompute 1f1b×4``. ``layout`` has ``ParallelConfig``'s
    field names (a ``ParallelConfig``, the planner's ``Candidate``); ``cp=N`` follows dp where
    context parallelism is on (cp > 1); ``recompute`` is every layer's activation checkpointing
    (``recompute-every-k`` every k-th), and with pp > 1 the pipeline schedule comes with its
    microbatches. With ``micro_batch_size`` (and ``grad_accum``), `` mbs=4 accum=2`` follows."""
    parts = [f"tp={layout.tp}", f"pp={layout.pp}", f"dp={layout.dp}"] + [f"cp={layout.cp}"] * (layout.cp > 1)
    parts += ["zero1"] * bool(layout.zero_1) + ["sp"] * bool(layout.sequence_parallel)
    k = layout.activation_checkpointing
    if k:
        parts.append("recompute" if k == 1 else f"recompute-every-{k}")
    if layout.pp > 1:
        parts.append(f"{layout.pipeline_schedule}×{layout.num_microbatches}")
    if micro_batch_size is not None:
        parts.append(f"mbs={micro_batch_size} accum={grad_accum}")
    return " ".join(parts)


def tp_problems(shape: ModelShape, tp: int, *, vocab: bool = True) -> list[str]:
    """Why tensor parallelism of degree ``tp`` cannot split this model (empty when it can).

    Heads and the MLP width must divide by tp; KV heads must divide by tp or, when tp exceeds
    them, divide tp (each KV head is then replicated on tp / kv ranks); the vocabulary must
    divide by tp when the embedding or lm_head is on the rank (``vocab``)."""
    heads, kv, inter, v = shape.num_heads, shape.num_kv_heads, shape.intermediate_size, shape.vocab_size
    out = []
    if heads % tp:
        out.append(f"tp={tp} does not divide num_attention_heads={heads}")
    if tp > kv and tp % kv:
        out.append(f"tp={tp} > num_key_value_heads={kv} needs tp to be a multiple of it (KV heads are replicated)")
    if tp < kv and kv % tp:
        out.append(f"tp={tp} does not divide num_key_value_heads={kv}")
    if inter % tp:
        out.append(f"tp={tp} does not divide intermediate_size={inter}")
    if vocab and v % tp:
        out.append(
            f"tp={tp} does not divide vocab_size={v}: pad the vocabulary to {-(-v // tp) * tp} rows "
            f"(model.resize_token_embeddings({v}, pad_to_multiple_of={tp}), then save the model)"
        )
    return out


def check_tp(shape: ModelShape, tp: int, *, vocab: bool = True) -> None:
    """Raise ``ValueError`` listing ``tp_problems`` and the tp degrees this model takes."""
    problems = tp_problems(shape, tp, vocab=vocab)
    if problems:
        valid = [t for t in divisors(shape.num_heads) if not tp_problems(shape, t, vocab=vocab)]
        raise ValueError(f"{'; '.join(problems)}; valid tp for this model: {valid}")


def _check_positions(job: JobConfig) -> None:
    """A row longer than the model's position range trains positions it was never built for."""
    path = Path(job.model_path) / "config.json"
    if not path.is_file():
        return
    config = json.loads(path.read_text())
    limit = config.get("max_position_embeddings") or config.get("text_config", {}).get("max_position_embeddings")
    if limit and job.block_size > limit:
        raise ValueError(
            f"data.block_size={job.block_size} exceeds the model's max_position_embeddings={limit} "
            f"({job.model_path}); use data.block_size <= {limit}, or a model whose position range covers it"
        )


def check_layout(job: JobConfig) -> CheckedLayout:
    """Validate ``job.parallel`` against the model at ``job.model_path`` and the batch; raises
    ``ValueError`` naming the numbers at fault and a valid alternative."""
    pc = job.parallel
    shape = ModelShape.from_config(job.model_path)
    check_tp(shape, pc.tp)
    split = split_layers(shape.num_layers, pc.num_stages, pc.layer_split)
    if pc.pp > 1 and pc.pipeline_schedule in ("1f1b", "interleaved_1f1b") and pc.num_microbatches < pc.pp:
        raise ValueError(
            f"parallel.num_microbatches={pc.num_microbatches} is below pp={pc.pp}; the {pc.pipeline_schedule} "
            f"schedule needs num_microbatches >= pp (e.g. {pc.pp})"
        )
    mbs = job.train.micro_batch_size
    if pc.pp > 1 and mbs % pc.num_microbatches:
        raise ValueError(
            f"train.micro_batch_size={mbs} is not divisible by parallel.num_microbatches={pc.num_microbatches}; "
            f"use num_microbatches in {divisors(mbs)} or a micro_batch_size that is a multiple of "
            f"{pc.num_microbatches}"
        )
    problem = context_problem(pc.cp, job.block_size, pc.tp, pc.sequence_parallel)
    if problem:
        raise ValueError(problem)
    if pc.sequence_parallel and job.block_size % pc.tp:
        raise ValueError(
            f"sequence parallelism splits the {job.block_size}-token sequence over tp={pc.tp}; "
            f"use a data.block_size divisible by {pc.tp}"
        )
    _check_positions(job)
    notes = []
    if pc.tp > shape.num_kv_heads:
        notes.append(f"KV heads replicated {pc.tp // shape.num_kv_heads}x (tp={pc.tp} > {shape.num_kv_heads} KV heads)")
    advice = block_size_advice(job.device, job.data.documents, job.block_size, shape.head_dim, pc.cp)
    if advice:
        notes.append(advice)
    return CheckedLayout(
        parallel=pc,
        world_size=pc.world_size,
        global_batch_size=job.global_batch_size,
        num_parameters=shape.num_parameters,
        layers_per_stage=[len(r) for r in split],
        micro_batch_size=mbs,
        grad_accum=job.grad_accum,
        notes=notes,
    )
