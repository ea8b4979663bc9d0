"""The plan step as a Prefect task (``tasks.steps.plan``), publishing the ranking as a table."""

from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact

from neuron_parallel.data import TokenizedDataset
from neuron_parallel.planning.layout import CheckedLayout

from . import steps
from .common import STEP_POLICY
from .config import FinetuneConfig

GiB = 1 << 30


@task(name="plan", **STEP_POLICY)
def plan(config: FinetuneConfig, dataset: TokenizedDataset) -> CheckedLayout:
    log = get_run_logger()
    layout, search = steps.plan(config, steps.model_dir(config), dataset.path, log=log.info)
    pc = layout.parallel
    chosen = {
        "dp": pc.dp,
        "tp": pc.tp,
        "pp": pc.pp,
        "cp": pc.cp,
        "zero_1": pc.zero_1,
        "sequence_parallel": pc.sequence_parallel,
        "num_microbatches": pc.num_microbatches,
        "pipeline_schedule": pc.pipeline_schedule,
        "activation_checkpointing": pc.activation_checkpointing,
        "micro_batch_size": layout.micro_batch_size,
        "grad_accum": layout.grad_accum,
        "global_batch_size": layout.global_batch_size,
        "parameters": layout.num_parameters,
        "layers_per_stage": str(layout.layers_per_stage),
    }
    if search is None:
        create_table_artifact(key="plan", table=[chosen], description="Parallel layout given in the config, checked")
    else:
        create_table_artifact(
            key="plan",
            table=ranking_rows(search),
            description=(
                f"Layouts of {search.world_size} {search.hardware.name} ranks, best first (rank 1 is used); "
                f"fixed in the config: {config.pinned() or 'nothing'}"
            ),
        )
    log.info("layout: %s", chosen)
    return layout


def ranking_rows(search, limit: int = 25) -> list[dict]:
    """The best ``limit`` fitting layouts, then one rejected layout per (tp, pp, cp) with its reason."""
    rows, seen = [], set()
    fitting = [c for c in search.candidates if c.fits][:limit]
    rejected = []
    for c in search.candidates:
        if not c.fits and (c.tp, c.pp, c.cp) not in seen:
            seen.add((c.tp, c.pp, c.cp))
            rejected.append(c)
    for i, c in enumerate(fitting + rejected[:limit]):
        rows.append(
            {
                "rank": i + 1 if c.fits else "-",
                "layout": c.describe(),
                "fits": c.fits,
                "GiB_per_rank": round(c.memory_per_rank_bytes / GiB, 3) if c.memory_per_rank_bytes else None,
                "tokens_per_s": round(c.tokens_per_s) if c.tokens_per_s else None,
                "mfu": round(c.mfu, 3) if c.mfu else None,
                "why_not": c.reason or "",
            }
        )
    return rows
