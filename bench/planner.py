"""The planner's memory model against measured peak memory per rank, on CPU with real training.

    .venv/bin/python bench/planner.py [--quick] [--steps N] [--cases NAME,NAME]

Every case is a real training run through the real entry point, one torchrun job per case,
launched by the project's launcher ``neuron_parallel.testing.ranks.run_ranks`` (``torchrun --standalone
--nproc_per_node N bench/planner.py --worker job.json``); each rank reports its peak with
``print_rank_result``. The worker imports ``neuron_parallel.train``, replaces its checkpoint
writer by a no-op (a save is not part of a training step's memory and the final step always
saves) and runs ``run_training(job)`` unchanged inside the measurement. Models are tiny-to-small Llama shapes
from ``neuron_parallel.tiny.make_tiny_world`` (GQA, untied), data its pydoc corpus packed by
``neuron_parallel.data.tokenize_dataset``; fp32 on CPU with gloo; dp, tp, sp, pp (1F1B and
GPipe), cp, ZeRO-1 and recompute are varied; two more cases run the engine's bf16 autocast mode, and
the ``-lora`` cases train LoRA adapters on the frozen model (``train.lora``), predicted with the
same ``LoraConfig``.

How memory is measured: ``neuron_parallel.memprof`` (c10's CPU allocator reports every tensor
allocation and free to the profiler with a running total; counted in every thread; verified on a
known 150 MB pattern before the cases run). The profiler starts before ``run_training``, so the
model, gradients, optimizer state, activations, pipeline buffers and every temporary an op
allocates are counted. Engine methods are wrapped in ``record_function`` phase ranges so the
table can say in which phase (forward/backward, reduction, optimizer) the peak fell.

Prediction: ``neuron_parallel.planning.memory.job_rank_memory`` for that rank's (pp rank, dp rank), i.e.
the planner's own model, tensor bytes only (the allocator margin the planner adds for device
allocators is not tensor memory and is left out here). Constants are those stated in
``neuron_parallel/planning/memory.py``; nothing is fitted per case. A case passes when every rank is
within ±15 %; the table shows the rank with the largest measured peak.

Then the step-time model against AWS's published Neuron distributed training throughput for
Llama-3.1-8B and 70B (NeuronX Distributed on 32 × trn1.32xlarge): predicted and published tokens/s
per instance, for information.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
import time
from pathlib import Path

from bench_util import RESULTS, parser, print_table, run_ranks_child, verdict, write_results

from neuron_parallel.checkpoint.output import claim_run_dir
from neuron_parallel.memprof import PHASE_PREFIX, TensorMemoryProfile, check_method
from neuron_parallel.planning.memory import job_rank_memory
from neuron_parallel.testing.ranks import print_rank_result

SMALL = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4)
WIDE = dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=2)
SHAPES = {"small": dict(SMALL), "wide": dict(WIDE, vocab_size=4096)}
# name: (shape, seq, world, parallel, micro_batch_size[, train.lora])
CASES = {
    "small-1rank": ("small", 256, 1, dict(), 4),
    "small-recompute": ("small", 256, 1, dict(activation_checkpointing=1), 4),
    "small-dp2": ("small", 256, 2, dict(), 4),
    "small-dp2-zero1": ("small", 256, 2, dict(zero_1=True), 4),
    "small-tp2": ("small", 256, 2, dict(tp=2), 4),
    "small-tp2-sp": ("small", 256, 2, dict(tp=2, sequence_parallel=True), 4),
    "small-pp2-1f1b": ("small", 256, 2, dict(pp=2, num_microbatches=4), 4),
    "small-pp2-gpipe": ("small", 256, 2, dict(pp=2, num_microbatches=4, pipeline_schedule="gpipe"), 4),
    "wide-dp2-zero1-recompute": ("wide", 256, 2, dict(zero_1=True, activation_checkpointing=1), 4),
    "wide-tp4-kvrep": ("wide", 128, 4, dict(tp=4), 4),
    "small-tp2-pp2": ("small", 256, 4, dict(tp=2, pp=2, num_microbatches=2), 2),
    # the engine's bf16 mode (fp32 states, autocast), predicted as precision="bf16_autocast"
    "small-1rank-bf16": ("small", 256, 1, dict(mixed_precision="bf16"), 4),
    "small-tp2-sp-bf16": ("small", 256, 2, dict(tp=2, sequence_parallel=True, mixed_precision="bf16"), 4),
    # LoRA on the frozen model: adapters on the 7 projections (and the lm_head trained in full)
    "small-1rank-lora": ("small", 256, 1, dict(), 4, dict(r=8)),
    "small-tp2-sp-lora": ("small", 256, 2, dict(tp=2, sequence_parallel=True), 4, dict(r=8)),
    "small-pp2-1f1b-lora": ("small", 256, 2, dict(pp=2, num_microbatches=4), 4, dict(r=8)),
    "small-dp2-zero1-lora-head": ("small", 256, 2, dict(zero_1=True), 4, dict(r=16, modules_to_save=["lm_head"])),
    "wide-tp4-kvrep-lora": ("wide", 128, 4, dict(tp=4), 4, dict(r=8)),
    "small-1rank-bf16-lora": ("small", 256, 1, dict(mixed_precision="bf16"), 4, dict(r=8)),
    # context parallelism: each rank 128 of every row's 256 tokens, K/V gathered over the cp ranks
    "small-cp2": ("small", 256, 2, dict(cp=2), 4),
    "small-cp2-zero1-recompute": ("small", 256, 2, dict(cp=2, zero_1=True, activation_checkpointing=1), 4),
    "small-cp2-tp2-sp": ("small", 256, 4, dict(cp=2, tp=2, sequence_parallel=True), 4),
}
CASE_TIMEOUT_S = 1800
"""Wall-clock limit of one case's launch (the largest cases take a few minutes on 2 cores)."""
QUICK = ["small-1rank", "small-tp2-sp", "small-pp2-1f1b"]
"""The cases of ``--quick``: one rank, tensor and sequence parallel, pipeline parallel."""


def _in_phase(fn, name: str):
    """``fn`` (an Engine method) inside a ``record_function`` range named for its phase."""
    from torch.profiler import record_function

    def wrapped(self, *args, **kwargs):
        with record_function(f"{PHASE_PREFIX}{name}"):
            return fn(self, *args, **kwargs)

    return wrapped


def worker(job_path: str) -> None:
    """Inside torchrun: run_training(job) under the memory profiler; each rank reports its peak
    with ``print_rank_result``."""
    import torch

    import neuron_parallel.train as train
    from neuron_parallel.config import JobConfig
    from neuron_parallel.engine import Engine

    class NoCheckpoints:
        def __init__(self, *args, **kwargs):
            pass

        def save(self, step, **kwargs):
            return Path("(not saved by the bench)")

        def wait(self):
            pass

        def check(self):
            pass

        def remove_partial(self):
            return []

    train.CheckpointWriter = NoCheckpoints
    for name in ("forward_backward", "reduce_and_clip", "optimizer_step"):
        setattr(Engine, name, _in_phase(getattr(Engine, name), name))
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    with TensorMemoryProfile() as probe:
        train.run_training(JobConfig.load(job_path))
    print_rank_result({"rank": rank, **probe.peak()})


def run_case(name: str, worlds: dict, work: Path, steps: int) -> dict:
    from neuron_parallel.config import DataConfig, JobConfig, LoraConfig, ParallelConfig, TrainConfig
    from neuron_parallel.data import tokenize_dataset
    from neuron_parallel.planning.memory import ModelShape

    shape_name, seq, world, parallel, mbs, *lora = CASES[name]
    lora = LoraConfig(**lora[0]) if lora else None
    paths = worlds[shape_name]
    ds = tokenize_dataset(
        source=paths["corpus"], tokenizer_dir=paths["model"], block_size=seq, cache_dir=work / "datasets"
    )
    run_dir = work / name
    run_dir.mkdir(parents=True, exist_ok=True)
    pc = ParallelConfig.for_world(world, **parallel)
    job = JobConfig(
        model_path=paths["model"],
        dataset_path=ds.path,
        output_dir=str(run_dir),
        data=DataConfig(source=paths["corpus"], block_size=seq, cache_dir=str(work / "datasets")),
        parallel=pc,
        # one micro batch per dp rank and step: no gradient accumulation
        train=TrainConfig(
            max_steps=steps,
            save_every=0,
            global_batch_size=mbs * pc.dp,
            micro_batch_size=mbs,
            lr=1e-3,
            log_every=1,
            lora=lora,
        ),
    )
    claim_run_dir(run_dir)  # a run writes only into a folder the tool claimed, as the launcher does
    (run_dir / "job.json").write_text(job.to_json())
    t0 = time.perf_counter()
    args = ["--worker", str(run_dir / "job.json")]
    res, _ = run_ranks_child(Path(__file__).resolve(), world, args, threads=1, timeout=CASE_TIMEOUT_S, label=name)
    shape = ModelShape.from_config(paths["model"])
    peaks = res.by_rank
    ranks = []
    for r in range(world):
        (meas,) = peaks[r]
        pred = job_rank_memory(shape, job, r)
        ranks.append(
            {
                "rank": r,
                "measured": meas["peak"],
                "measured_phase": meas["phase"],
                "measured_phases": meas["phases"],
                "predicted": pred.as_dict(),
                "error": pred.total / meas["peak"] - 1,
            }
        )
    worst = max(ranks, key=lambda x: x["measured"])
    return {
        "case": name,
        "world": world,
        "parallel": parallel,
        "seq": seq,
        "micro_batch_size": mbs,
        "lora": dataclasses.asdict(lora) if lora else None,
        "ranks": ranks,
        "worst": worst,
        "max_abs_error": max(abs(x["error"]) for x in ranks),
        "wall_s": time.perf_counter() - t0,
        "loadavg": os.getloadavg(),  # memory does not depend on load; recorded for the wall time
    }


def _world(path: Path, shape: dict) -> dict:
    from neuron_parallel.tiny import make_tiny_world

    if (path / "model" / "config.json").is_file():  # a kept --workdir
        return {"model": str(path / "model"), "corpus": str(path / "corpus.jsonl")}
    return make_tiny_world(path, **shape)


def _mb(x: float) -> str:
    return f"{x / 2**20:.1f}"


def report(results: list[dict]) -> None:
    """Predicted components and total against the measured peak, per case."""
    cols = ["params", "grads", "optimizer", "activations", "loss", "pipeline_buffers", "transient", "comm_buffers"]
    print("\nPeak tensor memory per rank, MiB (rank with the largest measured peak; max|err| over all ranks)")
    rows = []
    for res in results:
        w = res["worst"]
        p = w["predicted"]
        rows.append(
            [res["case"], str(w["rank"]), *(_mb(p[c]) for c in cols), _mb(p["total"]), _mb(w["measured"])]
            + [f"{100 * w['error']:+.1f}", f"{100 * res['max_abs_error']:.1f}", verdict(res["max_abs_error"] <= 0.15)]
            + [f"{p['phase']}/{w['measured_phase']}"]
        )
    headers = ["case", "rank", *(c[:7] for c in cols), "pred", "meas", "err%", "max%", "±15%", "phase (pred/meas)"]
    print_table(headers, rows)


# AWS's published Neuron distributed training throughput for Llama-3.1 (NeuronX Distributed
# performance tables, AWS Neuron documentation) on 32 × trn1.32xlarge, seq 8192, bf16, global
# batch 1024 (our assumption); sequences/s of the whole job.
ANCHORS = {
    "Llama-3.1-8B TP32 DP32 ZeRO-1": (
        dict(
            hidden_size=4096,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            intermediate_size=14336,
            vocab_size=128256,
        ),
        (32, 1, 32),
        (42, 48),
    ),
    "Llama-3.1-70B TP32 PP8 DP4": (
        dict(
            hidden_size=8192,
            num_hidden_layers=80,
            num_attention_heads=64,
            num_key_value_heads=8,
            intermediate_size=28672,
            vocab_size=128256,
        ),
        (32, 8, 4),
        (7.5, 7.9),
    ),
}


def anchors() -> list[dict]:
    """Predicted tokens/s of the published layouts (with SP, recompute, ZeRO-1, 1F1B, the
    fastest microbatching that fits) against the published figures; information only."""
    from neuron_parallel.planning.search import search_layouts

    rows = []
    for name, (config, split, published) in ANCHORS.items():
        report = search_layouts(config, "trn1.32xlarge", nodes=32, seq_len=8192, global_batch=1024)
        same = [
            c
            for c in report.candidates
            if c.fits
            and (c.tp, c.pp, c.dp) == split
            and c.zero_1
            and c.sequence_parallel
            and c.activation_checkpointing
            and c.pipeline_schedule == "1f1b"
        ]
        c = max(same, key=lambda c: (float(f"{c.tokens_per_s:.3g}"), -c.memory_per_rank_bytes))
        published = tuple(x * 8192 / 32 for x in published)  # sequences/s → tokens/s per instance
        rows.append(
            {
                "case": name,
                "layout": c.describe(),
                "predicted_per_instance": c.tokens_per_s / 32,
                "published_per_instance": published,
                "mfu": c.mfu,
                "memory_GiB": c.memory_per_rank_bytes / 2**30,
                "best_layout": report.best.describe(),
                "best_per_instance": report.best.tokens_per_s / 32,
            }
        )
        lo, hi = published
        print(
            f"{name}: predicted {c.tokens_per_s / 32:,.0f} tokens/s per instance ({c.mfu:.0%} MFU, "
            f"{c.memory_per_rank_bytes / 2**30:.1f} GiB/rank) vs published {lo:,.0f}-{hi:,.0f}; "
            f"planner's best {report.best.describe()}: {report.best.tokens_per_s / 32:,.0f}"
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__, f"only the cases {', '.join(QUICK)}")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--cases", help="comma-separated case names")
    ap.add_argument("--workdir", help="keep models, datasets and jobs here (default: a temporary directory)")
    args = ap.parse_args(argv)
    print(f"measurement check: known 150 MB pattern reads {check_method():,} bytes")
    names = args.cases.split(",") if args.cases else (QUICK if args.quick else list(CASES))
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-planner-") as tmp:
        work = Path(args.workdir or tmp)
        worlds = {name: _world(work / name, shape) for name, shape in SHAPES.items()}
        for name in names:
            res = run_case(name, worlds, work, args.steps)
            results.append(res)
            print(
                f"{name}: worst rank {res['worst']['rank']} error {100 * res['worst']['error']:+.1f}% "
                f"(max |err| {100 * res['max_abs_error']:.1f}%), {res['wall_s']:.0f}s",
                flush=True,
            )
    report(results)
    print(
        "\nStep-time model against AWS's published Neuron training throughput for Llama-3.1 "
        "(32 × trn1.32xlarge, seq 8192, bf16):"
    )
    rows = anchors()
    ok = all(r["max_abs_error"] <= 0.15 for r in results)
    print(f"\n{sum(r['max_abs_error'] <= 0.15 for r in results)}/{len(results)} cases within ±15% on every rank")
    write_results(RESULTS / "planner.json", {"cases": results, "within_15pct": ok, "anchors": rows})
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "--worker":
        worker(sys.argv[2])
    else:
        sys.exit(main())
