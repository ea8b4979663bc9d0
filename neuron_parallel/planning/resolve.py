"""From a request with some layout fields left open to the layout a job runs.

A request pins some of ``PLANNED_FIELDS`` (the layout and the micro batch) and leaves the rest
to the search: the fastest layout that fits the hardware, keeping every pinned value. A request
that pins everything is taken as given. Either way the result is then checked against the model
(``layout.check_layout``) by the caller that builds the job.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import LAYOUT_FIELDS, LaunchConfig, LoraConfig, ParallelConfig, resolve_precision
from ..utils import divisors
from .layout import context_problem
from .search import FIXABLE, Candidate, LayoutSearch, search_layouts

DEVICE_HARDWARE = {"cpu": "cpu", "cuda": "p5.48xlarge", "neuron": "trn2.48xlarge"}
"""The hardware kind planned for when none is named, by device."""


@dataclass(frozen=True, slots=True)
class ResolvedLayout:
    """The layout and micro batch a request resolves to, and the search that chose them (None
    when the request pinned everything)."""

    parallel: ParallelConfig
    micro_batch_size: int
    search: LayoutSearch | None = None

    @property
    def chosen(self) -> Candidate | None:
        return self.search.best if self.search else None


def check_pinned(
    fixed: dict[str, Any], *, world_size: int, layer_split: list[int] | None, block_size: int | None = None
) -> None:
    """What can be checked of a partly pinned layout before the model is read (with
    ``block_size``, ``data.block_size``, against a pinned cp too); raises ``ValueError`` naming
    the fix."""
    cp = fixed.get("cp", 1)
    ParallelConfig(cp=cp)  # refuses a cp that is not an integer >= 1, naming parallel.cp
    if world_size % cp:
        raise ValueError(
            f"parallel.cp={cp} does not divide the world size {world_size} (launch.nproc_per_node × launch.nnodes); "
            f"use parallel.cp in {divisors(world_size)}, or auto"
        )
    sp = fixed.get("sequence_parallel") is True
    problem = context_problem(cp, block_size, fixed.get("tp", 1), sp) if block_size else None
    if problem:
        raise ValueError(problem)
    if set(FIXABLE) <= set(fixed):
        ParallelConfig.for_world(world_size, layer_split=layer_split, **{k: fixed[k] for k in LAYOUT_FIELDS})
        return
    tp, pp = fixed.get("tp", 1), fixed.get("pp", 1)
    if world_size % (tp * pp * cp):
        ParallelConfig.for_world(world_size, tp=tp, pp=pp, cp=cp)  # raises, listing the splits that divide
    if fixed.get("sequence_parallel") is True and tp == 1:
        raise ValueError("parallel.sequence_parallel needs parallel.tp > 1; set sequence_parallel=false or raise tp")
    if layer_split is not None and "pp" not in fixed:
        raise ValueError(
            "parallel.layer_split needs a fixed parallel.pp (one layer count per stage); set pp or drop layer_split"
        )
    if fixed.get("pipeline_schedule") == "zbv":
        raise ValueError(
            "the planner does not model pipeline_schedule=zbv; with zbv give the whole layout "
            f"({', '.join(FIXABLE)}), or choose another schedule"
        )


def pinned_layout(
    fixed: dict[str, Any], *, world_size: int, mixed_precision: str = "auto", layer_split: list[int] | None = None
) -> ResolvedLayout | None:
    """The layout of a request that pins every field of ``FIXABLE``, as given (no search, no
    model read); None when something is left to the planner."""
    if not set(FIXABLE) <= set(fixed):
        return None
    pc = ParallelConfig.for_world(
        world_size, mixed_precision=mixed_precision, layer_split=layer_split, **{k: fixed[k] for k in LAYOUT_FIELDS}
    )
    return ResolvedLayout(parallel=pc, micro_batch_size=fixed["micro_batch_size"])


def resolve_layout(
    model_path: str | Path,
    fixed: dict[str, Any],
    *,
    launch: LaunchConfig,
    hardware: str | None,
    seq_len: int,
    global_batch_size: int,
    mixed_precision: str = "auto",
    layer_split: list[int] | None = None,
    lora: LoraConfig | None = None,
    memory_fraction: float | None = None,
    documents: bool = False,
    objective: str = "sft",
) -> ResolvedLayout:
    """The layout for ``fixed`` (pinned values of ``FIXABLE``) on ``launch``'s ranks.

    Pinning every field returns it as given. Otherwise ``search_layouts`` ranks every layout of
    the world on ``hardware`` (default by device, ``DEVICE_HARDWARE``) for this sequence length,
    global batch, precision and training (full, or ``lora``'s adapters), keeping the pinned
    values; the fastest that fits within ``memory_fraction`` of a rank's memory (default
    ``launch.memory_fraction``) wins; ``documents``: rows packed from documents (their attention
    path's memory is planned for); ``objective``: ``train.objective`` (DPO under LoRA's reference
    forward is planned for). Raises ``ValueError`` with the search's reason when
    nothing fits. ``mixed_precision`` ``auto`` is planned, and returned, as what
    ``launch.device`` runs (``neuron_parallel.config.resolve_precision``)."""
    world = launch.nproc_per_node * launch.nnodes
    mixed_precision = resolve_precision(mixed_precision, launch.device)
    check_pinned(fixed, world_size=world, layer_split=layer_split, block_size=seq_len)
    pinned = pinned_layout(fixed, world_size=world, mixed_precision=mixed_precision, layer_split=layer_split)
    if pinned is not None:
        return pinned
    fixed = dict(fixed)
    if layer_split is not None and "virtual_stages" not in fixed:
        fixed["virtual_stages"] = max(1, len(layer_split) // fixed["pp"])  # one count per stage
    search = search_layouts(
        Path(model_path) / "config.json",
        hardware or DEVICE_HARDWARE[launch.device],
        nodes=launch.nnodes,
        seq_len=seq_len,
        global_batch=global_batch_size,
        precision="fp32" if mixed_precision == "fp32" else "bf16_autocast",
        ranks_per_node=launch.nproc_per_node,
        fixed=fixed,
        lora=lora,
        memory_fraction=launch.memory_fraction if memory_fraction is None else memory_fraction,
        documents=documents,
        objective=objective,
    )
    best = search.best
    if best is None:
        raise ValueError(f"no parallel layout fits: {search.reason}")
    # replace() re-runs ParallelConfig's checks with the precision and split asked for
    pc = dataclasses.replace(best.to_parallel_config(), mixed_precision=mixed_precision, layer_split=layer_split)
    return ResolvedLayout(parallel=pc, micro_batch_size=best.micro_batch_size, search=search)
