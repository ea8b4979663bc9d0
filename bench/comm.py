"""Communication audit of one training step: every collective of every rank, by kind, against the
least the layout must move.

    .venv/bin/python bench/comm.py [--quick] [--layout dp2-tp2-pp2 --layout tp4] [--out bench/results/comm.json]

Layouts: ``dp2-tp2-pp2`` (sequence parallel, ZeRO-1, 1F1B with 2 microbatches; 8 ranks),
``tp4`` (sequence parallel; 4 ranks, the tiny model's 2 KV heads each replicated on 2 ranks) and
``dp2-cp2`` (context parallel, ZeRO-1 over the dp × cp ranks; 4 ranks: the K/V all-gather and
its gradients' reduce-scatter against ``2·b·S·kv·d`` per layer), on
the tiny Llama world (``neuron_parallel.tiny``, hidden 128, 4 layers, vocabulary 2048) in fp32,
block 32, 4 sequences per rank; ``--quick`` audits ``tp4`` only. Every rank runs the audit
``tests/dist/test_comm.py`` runs too, ``neuron_parallel.testing.comm_audit`` as a module: it builds
its engine through the real path (``build_engine``) and runs ``Trainer.train_step``; step 1 is a
warm-up (the pipeline's shape inference sends objects once), step 2 is recorded by
``CollectiveLog``, which sees ``torch.distributed`` calls, point-to-point ops and DTensor's
functional collectives alike, labelled by engine phase.

The table gives, per kind and process-group axis, the collectives and payload bytes summed over
all ranks, the analytic minimum (``comm_audit.minimum_bytes``, summed likewise), their ratio and the
worst rank's ratio; scalar collectives (losses, token counts, the gradient norm: at most 16
elements) are listed apart. Goal: bytes <= 1.10x the minimum, and no collective count that grows
with the number of parameters (the ``reduce_and_clip``/``optimizer_step`` counts are shown next
to the number of parameters each rank holds). ``dp all_reduce`` issued during
``forward_backward`` are the gradient buckets that started while backward was running.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from bench_util import RESULTS, loadavg, log, parser, print_table, run_ranks_child, verdict, write_results

from neuron_parallel.testing.comm_audit import GOAL, LAYOUTS, RANK_MODULE, aggregate

MBS, BLOCK = 4, 32
QUICK = ["tp4"]


def write_job(tmp: Path, name: str, world: dict) -> Path:
    from neuron_parallel.config import DataConfig, JobConfig, ParallelConfig, TrainConfig

    n, parallel = LAYOUTS[name]
    par = ParallelConfig.for_world(n, **parallel)
    job = JobConfig(
        model_path=world["model"],
        dataset_path=world["dataset"],
        output_dir=str(tmp / name),
        data=DataConfig(block_size=BLOCK),
        parallel=par,
        train=TrainConfig(micro_batch_size=MBS, global_batch_size=MBS * par.dp, max_steps=2, save_every=0),
    )
    path = tmp / f"{name}.json"
    path.write_text(job.to_json())
    return path


def report(name: str, rows: list[dict], results: list[dict]) -> dict:
    """The layout's table, its totals against the goal, and the summary written to the results."""
    print(f"\n{name}: {len(results)} ranks, one optimizer step, sums over ranks")
    table = []
    for r in rows:
        table.append(
            [
                r["kind"] + (" (scalars)" if r["scalar"] else ""),
                r["axis"],
                str(r["count"]),
                f"{r['bytes']:,}",
                f"{r['minimum_bytes']:,.0f}",
                f"{r['ratio']:.3f}x" if r["ratio"] is not None else "-",
                f"{r['worst_rank_ratio']:.3f}x" if r["minimum_bytes"] else "-",
                ", ".join(f"{k} {v}" for k, v in sorted(r["phases"].items())),
            ]
        )
    print_table(["kind", "axis", "count", "bytes", "minimum", "ratio", "worst rank", "phases"], table)
    total = sum(r["bytes"] for r in rows if not r["scalar"])
    minimum = sum(r["minimum_bytes"] for r in rows if not r["scalar"])
    per_param = max(
        sum(
            c
            for row in res["rows"]
            for p, c in row.get("phases", {}).items()
            if p in ("reduce_and_clip", "optimizer_step")
        )
        for res in results
    )
    params = max(res["num_params"] for res in results)
    met = total <= GOAL * minimum
    print(
        f"total (non-scalar) {total:,} bytes vs minimum {minimum:,.0f}: {total / minimum:.3f}x "
        f"(goal <= {GOAL}x: {verdict(met)})"
    )
    print(f"collectives in reduce_and_clip + optimizer_step, worst rank: {per_param} (<= {params} parameters a rank)")
    return {"total_bytes": total, "minimum_bytes": minimum, "ratio": total / minimum, "met": met}


def main() -> int:
    ap = parser(__doc__, f"layouts {', '.join(QUICK)} only")
    ap.add_argument("--layout", action="append", choices=sorted(LAYOUTS), help="default: all")
    ap.add_argument("--out", default=str(RESULTS / "comm.json"))
    args = ap.parse_args()
    from neuron_parallel.data import tokenize_dataset
    from neuron_parallel.tiny import make_tiny_world

    out = {"loadavg_start": loadavg(), "layouts": {}}
    with tempfile.TemporaryDirectory(prefix="np-comm-") as tmp_s:
        tmp = Path(tmp_s)
        world = make_tiny_world(tmp / "world")
        data = tokenize_dataset(
            source=world["corpus"], tokenizer_dir=world["model"], block_size=BLOCK, cache_dir=tmp / "ds"
        )
        world["dataset"] = str(data.path)
        for name in args.layout or (QUICK if args.quick else list(LAYOUTS)):
            n = LAYOUTS[name][0]
            log(f"{name}: {n} ranks")
            job = str(write_job(tmp, name, world))
            res, _ = run_ranks_child(RANK_MODULE, n, [job], threads=1, timeout=600, label=name)
            rows = aggregate(res.results)
            summary = report(name, rows, res.results)
            out["layouts"][name] = {"rows": rows, **summary, "ranks": res.results}
    out["loadavg_end"] = loadavg()
    print()
    write_results(args.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
