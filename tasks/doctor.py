"""A run's config as the host check sees it (``neuron_parallel.doctor``): for
``neuron-flows doctor --config`` and for the preflight step, which runs the quick part (the stack
and one rank) on accelerator workers."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from neuron_parallel.doctor import DoctorTarget, run_doctor
from neuron_parallel.utils import names_local_path

from .config import FinetuneConfig

Plan = Callable[[FinetuneConfig, str], tuple]
"""The plan step (``tasks.steps.plan``), which its caller hands in."""


def doctor_target(
    config: FinetuneConfig, plan: Plan | None = None, *, from_file: bool = True, work_dir: str | None = None
) -> DoctorTarget:
    """What ``config`` asks of a host: its launch, its layout (as given, else ``plan``'s on a local
    model, else tp and pp as given over every rank), its model, sequence, micro batch and output
    directory. ``from_file`` False (no config given): its launch only, data parallelism over every
    rank, the tiny model."""
    launch = config.to_launch()
    extra = {"work_dir": work_dir} if work_dir else {}
    if not from_file:
        return DoctorTarget.for_launch(launch, config.hardware, **extra)
    name = config.model.name_or_path
    model_dir = None
    if Path(name).expanduser().exists() or names_local_path(name):
        from neuron_parallel.models import resolve_model_dir

        model_dir = resolve_model_dir(name)  # refused here if it is not a model directory
    layout = config.pinned_layout()
    if layout is None and model_dir and plan is not None:
        layout, _ = plan(config, model_dir)
    if layout is not None:
        parallel, micro_batch = layout.parallel, layout.micro_batch_size
    else:
        from neuron_parallel.config import ParallelConfig

        pinned = config.pinned()
        parallel = ParallelConfig.for_world(
            config.world_size, tp=pinned.get("tp", 1), pp=pinned.get("pp", 1), cp=pinned.get("cp", 1)
        )
        micro_batch = pinned.get("micro_batch_size", 1)
    train = config.library("train", micro_batch_size=1)
    return DoctorTarget(
        launch=launch,
        parallel=parallel,
        hardware=config.hardware,
        model_dir=model_dir,
        model_name=name,
        seq_len=config.data.block_size,
        micro_batch_size=micro_batch,
        output_dir=config.output.dir,
        lora=train.lora,
        optimizer=train.optimizer,
        **extra,
    )


def check_host(config: FinetuneConfig, plan: Plan | None = None) -> None:
    """The quick part of the doctor (the stack and one rank on the device) for ``config``;
    raises ``ValueError`` naming every failed check and its fix."""
    failed = [c for c in run_doctor(doctor_target(config, plan), quick=True) if not c.ok]
    if failed:
        raise ValueError(
            "this host fails the checks the run needs: "
            + "; ".join(f"{c.name}: {c.detail}" for c in failed)
            + " (`neuron-flows doctor --config CONFIG` runs every check)"
        )
