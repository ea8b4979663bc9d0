"""Communication audit of one training step: every collective of every rank, by kind, against the
least the layout must move.

    .venv/bin/python bench/comm.py [--layout dp2-tp2-pp2 --layout tp4] [--out bench/results/comm.json]

Layouts: ``dp2-tp2-pp2`` (sequence parallel, ZeRO-1, 1F1B with 2 microbatches; 8 ranks) and
``tp4`` (sequence parallel; 4 ranks, the tiny model's 2 KV heads each replicated on 2 ranks), on
the tiny Llama world (``neuron_parallel.tiny``, hidden 128, 4 layers, vocabulary 2048) in fp32,
block 32, 4 sequences per rank. Each rank builds its engine through the real path
(``build_engine``) and runs ``Trainer.train_step``; step 1 is a warm-up (the pipeline's
shape inference sends objects once), step 2 is recorded by
``neuron_parallel.parallel.comm_audit.CollectiveLog``, which sees ``torch.distributed`` calls,
point-to-point ops and DTensor's functional collectives alike, labelled by engine phase.

The table gives, per kind and process-group axis, the collectives and payload bytes summed over
all ranks, the analytic minimum (``comm_audit.minimum_bytes``, summed likewise), their ratio and the
worst rank's ratio; scalar collectives (losses, token counts, the gradient norm: at most 16
elements) are listed apart. Goal: bytes <= 1.10x the minimum, and no collective count that grows
with the number of parameters (the ``reduce_and_clip``/``optimizer_step`` counts are shown next
to the number of parameters each rank holds). ``dp all_reduce`` issued during
``forward_backward`` are the gradient buckets that started while backward was running.
"""

from __future__ import annotations

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE] + [_HERE]

import argparse
import json
import tempfile
from collections import defaultdict
from pathlib import Path

from bench_util import ROOT, loadavg, log, run_ranks_child  # bench/ is on sys.path

RESULTS = ROOT / "bench" / "results" / "comm.json"
LAYOUTS = {
    "dp2-tp2-pp2": (8, dict(tp=2, pp=2, sequence_parallel=True, zero_1=True, num_microbatches=2)),
    "tp4": (4, dict(tp=4, sequence_parallel=True)),
}
MBS, BLOCK = 4, 32
GOAL = 1.10


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


def worker(job_path: str) -> None:
    """One rank: build the engine, train step 1, record step 2, report the rows."""
    import torch

    from neuron_parallel.batches import BlockStream
    from neuron_parallel.config import JobConfig
    from neuron_parallel.engine import build_engine
    from neuron_parallel.launch import print_rank_result
    from neuron_parallel.mesh import ParallelDims, close_distributed, exit_rank, init_distributed
    from neuron_parallel.parallel.comm_audit import CollectiveLog, axis_names, engine_phases, rank_report
    from neuron_parallel.train import Trainer

    job = JobConfig.load(job_path)
    init_distributed(job.device)
    pc = job.parallel
    dims = ParallelDims(dp=pc.dp, pp=pc.pp, tp=pc.tp, device_type=job.device)
    engine = build_engine(job, dims, torch.device("cpu"))
    trainer = Trainer(job, engine, BlockStream(job.dataset_path, seed=job.train.seed), dims, None, None)
    trainer.train_step(1)
    clog = CollectiveLog(axis_names(dims.mesh))
    with clog, engine_phases(engine, clog):
        trainer.train_step(2)
    print_rank_result({**rank_report(clog, engine, job), **dims.coordinates()})
    close_distributed()
    exit_rank(0)


def aggregate(results: list[dict]) -> list[dict]:
    """Rows summed over ranks, with the worst rank's ratio and the per-phase counts."""
    rows: dict[tuple, dict] = {}
    for res in results:
        for r in res["rows"]:
            key = (r["kind"], r["axis"], r["scalar"])
            row = rows.setdefault(key, dict(kind=r["kind"], axis=r["axis"], scalar=r["scalar"], count=0, bytes=0))
            row.setdefault("minimum_bytes", 0.0)
            row.setdefault("phases", defaultdict(int))
            row.setdefault("worst_rank_ratio", 0.0)
            row["count"] += r["count"]
            row["bytes"] += r["bytes"]
            row["minimum_bytes"] += r["minimum_bytes"]
            for phase, c in r.get("phases", {}).items():
                row["phases"][phase] += c
            if r["minimum_bytes"]:
                row["worst_rank_ratio"] = max(row["worst_rank_ratio"], r["bytes"] / r["minimum_bytes"])
    out = sorted(rows.values(), key=lambda r: (r["scalar"], r["axis"], r["kind"]))
    for r in out:
        r["ratio"] = r["bytes"] / r["minimum_bytes"] if r["minimum_bytes"] else None
        r["phases"] = dict(r["phases"])
    return out


def print_table(name: str, rows: list[dict], results: list[dict]) -> dict:
    print(f"\n{name}: {len(results)} ranks, one optimizer step, sums over ranks")
    head = f"{'kind':<24}{'axis':<6}{'count':>7}{'bytes':>14}{'minimum':>14}{'ratio':>8}{'worst rank':>11}  phases"
    print(head)
    print("-" * len(head))
    total = minimum = 0
    for r in rows:
        ratio = f"{r['ratio']:.3f}" if r["ratio"] is not None else "-"
        worst = f"{r['worst_rank_ratio']:.3f}" if r["minimum_bytes"] else "-"
        phases = ", ".join(f"{k} {v}" for k, v in sorted(r["phases"].items()))
        kind = r["kind"] + (" (scalars)" if r["scalar"] else "")
        nums = f"{r['count']:>7}{r['bytes']:>14,}{r['minimum_bytes']:>14,.0f}{ratio:>8}{worst:>11}"
        print(f"{kind:<24}{r['axis']:<6}{nums}  {phases}")
        if not r["scalar"]:
            total += r["bytes"]
            minimum += r["minimum_bytes"]
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
    print(f"total (non-scalar) {total:,} bytes vs minimum {minimum:,.0f}: {total / minimum:.3f}x (goal <= {GOAL}x)")
    print(f"collectives in reduce_and_clip + optimizer_step, worst rank: {per_param} (<= {params} parameters a rank)")
    return {"total_bytes": total, "minimum_bytes": minimum, "ratio": total / minimum, "met": total <= GOAL * minimum}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layout", action="append", choices=sorted(LAYOUTS), help="default: all")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--_worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._worker:
        worker(args._worker)
        return 0
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
        for name in args.layout or list(LAYOUTS):
            n = LAYOUTS[name][0]
            log(f"{name}: {n} ranks")
            res, _ = run_ranks_child(
                Path(__file__), n, ["--_worker", str(write_job(tmp, name, world))], threads=1, timeout=600, label=name
            )
            rows = aggregate(res.results)
            summary = print_table(name, rows, res.results)
            out["layouts"][name] = {"rows": rows, **summary, "ranks": res.results}
    out["loadavg_end"] = loadavg()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"\nresults written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
