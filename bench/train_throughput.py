"""Training-throughput benchmark of neuron_parallel against baselines measured in the same run.

    .venv/bin/python bench/train_throughput.py [--quick] [--steps N] [--real-stages]

Everything runs on a tiny Llama world built in a temporary directory
(``neuron_parallel.tiny.make_tiny_world`` widened to hidden 256 / intermediate 704 so that matmuls
dominate the step) and its pydoc corpus packed by ``neuron_parallel.data.tokenize_dataset`` into
rows of 128 + 1 tokens. Every timed run is its own process. The results are printed as one table
(metric, ours, baseline, ratio, goal, met?) and written to ``bench/results/train_throughput.json``.
Nothing is hard-coded: every number is measured in this invocation.

1. One rank. neuron_parallel through its real entry point, launched by the project's launcher
   ``neuron_parallel.testing.ranks.run_ranks`` (``torchrun --standalone --nproc_per_node 1 -m
   neuron_parallel.train job.json``), read from the
   run's ``metrics.jsonl`` (``tokens_per_s``, ``step_time_s``; warm-up steps skipped; median),
   against a plain loop in its own process: ``AutoModelForCausalLM.from_pretrained`` of the same
   directory, the same batches from ``BlockStream`` (same seed, same sample positions), the same
   micro batch, next-token cross entropy over all positions (the HF loss with ``shift_labels``),
   ``torch.nn.utils.clip_grad_norm_`` at the job's max norm (ours clips too), and
   ``torch.optim.AdamW`` in its default implementation with the job's lr/betas/eps/weight decay,
   so both runs must follow the same loss curve: the largest loss difference is printed as proof
   that they did the same work. The plain loop times a step from data fetch to ``loss.item()``
   (on CPU the step's whole work, as ``train.py``'s ``step_time_s`` at ``log_every: 1`` is) with
   ``torch.set_num_threads`` = the rank's ``OMP_NUM_THREADS`` (default 1, the launcher's default;
   on a shared 2-core machine two OpenMP threads per process spin against other load and run
   several times slower, so 2 threads measure the neighbours, not the code).
2. dp=2. neuron_parallel on 2 ranks (OMP_NUM_THREADS=1 each, micro batch = half the 1-rank one, so
   the global batch is the same) against ``transformers.Trainer`` with DDP on 2 ranks: a script
   written to a temp file and launched by torchrun, same model, the same packed rows (a torch
   ``Dataset`` over the saved dataset, ``shift_labels`` for the all-positions loss), per-device
   batch = our micro batch, no eval/saving/logging, ``report_to="none"``,
   ``dataloader_num_workers=0``, ``use_cpu=True``, the job's lr/betas/clipping and Trainer's
   default optimizer (``adamw_torch_fused``). Trainer's step time is the median after warm-up of
   ``on_step_begin`` -> ``on_step_end`` in a ``TrainerCallback``; that window leaves out Trainer's
   batch fetch and its ``num_items_in_batch`` all-gather, so it favours Trainer (the full
   begin -> next-begin cycle is shown too). Trainer needs ``accelerate`` (the ``bench`` extra).
   Runs of parts 1 and 2 alternate (ours, baseline, baseline, ours, ...) over ``--rounds``.
   Cross-checks that other people's load cannot skew (info rows): while each run trains, the
   bench samples ``/proc/PID/task/*/schedstat`` of its worker processes every time its per-step
   log grows, giving per step the on-CPU time of all their threads (tokens per CPU-second) and
   the time their main threads sat runnable waiting for a core held by someone else; wall minus
   that wait estimates the step on a machine of our own (waiting for the other rank or for
   communication stays in).
3. Pipeline bubble, pp=2 and pp=4, 1F1B, m = 2p microbatches, against ``(p-1)/(m+p-1)``:
   ``pipeline_bubble.py`` (its docstring gives the method and its limits).
4. With CUDA: MFU of a ~1B Llama on one device (``mfu.py``). Without CUDA it is reported as skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

# bench/ is on sys.path (the running script's folder)
from bench_util import RESULTS, loadavg, log, parser, verdict, write_results
from mfu import run_mfu
from pipeline_bubble import FINE_GRAIN, GRAIN, run_pipe
from throughput_report import fmt, noise_note, pooled, print_table, row, sched_note, sched_rows
from throughput_runs import (
    BETAS,
    BLOCK_SIZE,
    LR,
    MAX_GRAD_NORM,
    MODEL_SHAPE,
    SEED,
    alternate,
    build_world,
    run_ours,
    run_plain,
    run_trainer,
    worker_plain,
    write_job,
)


@dataclass
class Bench:
    """One invocation: its settings, the tiny world, and the results, table rows and notes it collects."""

    quick: bool
    real_stages: bool
    steps: int
    warmup: int
    rounds: int
    threads: int
    mbs1: int
    mbs2: int
    pipe_steps: int
    tmp: Path = Path()
    world: dict = field(default_factory=dict)
    results: dict = field(default_factory=dict)
    rows: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def cross_checks(b: Bench, name: str, part: dict, sides: tuple[list[dict], list[dict], str], note: str) -> None:
    """The info rows of a wall-clock ratio, then the part's note and the load notes."""
    ours, base, base_name = sides
    sched_rows(b.rows, part, ours, base)
    b.notes.append(note)
    sched_note(b.notes, name, ours, base, base_name)
    noise_note(b.notes, name, part)


# --------------------------------------------------------------------------------------------
# part 1: one rank vs a plain loop


def part1(b: Bench) -> None:
    kw = dict(mbs=b.mbs1, steps=b.steps, warmup=b.warmup)
    ours, plain = alternate(
        "1",
        b.rounds,
        f"1 rank, {b.threads} threads, mbs {b.mbs1}, {b.steps} steps",
        lambda r: run_ours(b.tmp, b.world, nproc=1, threads=b.threads, tag=f"1rank-{r}", **kw),
        "plain",
        lambda r: run_plain(b.tmp, b.world, threads=b.threads, tag=f"1rank-{r}", **kw),
    )
    o_tps = pooled(ours, "tokens_per_s")
    p_tps = pooled(plain, "tokens_per_s")
    loss_diff = max(abs(x - y) for x, y in zip(ours[0]["losses"], plain[0]["losses"]))
    ratio = o_tps / p_tps
    part = {
        "ours": {"tokens_per_s": o_tps, "step_time_s": pooled(ours, "step_times"), "runs": ours},
        "plain": {"tokens_per_s": p_tps, "step_time_s": pooled(plain, "step_times"), "runs": plain},
        "ratio": ratio,
        "goal": 1.00,
        "met": ratio >= 1.00,
        "max_loss_diff": loss_diff,
    }
    b.results["part1_one_rank"] = part
    b.rows.append(
        row(
            f"tokens/s, 1 rank ({b.threads} thr) vs plain HF+AdamW",
            fmt(o_tps, "tps"),
            fmt(p_tps, "tps"),
            fmt(ratio, "ratio"),
            ">= 1.00x",
            verdict(ratio >= 1.00),
        )
    )
    note = (
        f"part 1: step time ours {part['ours']['step_time_s']:.3f}s vs plain "
        f"{part['plain']['step_time_s']:.3f}s (median of {len(ours) * (b.steps - b.warmup)} steps each); "
        f"largest loss difference over {b.steps} steps = {loss_diff:.2e} (same batches, same updates)"
    )
    cross_checks(b, "part 1", part, (ours, plain, "plain"), note)


# --------------------------------------------------------------------------------------------
# part 2: dp=2 vs HF Trainer DDP


def part2(b: Bench) -> None:
    kw = dict(nproc=2, mbs=b.mbs2, steps=b.steps, warmup=b.warmup)
    ours, hf = alternate(
        "2",
        b.rounds,
        f"2 ranks x 1 thread, mbs {b.mbs2}/rank, {b.steps} steps",
        lambda r: run_ours(b.tmp, b.world, threads=1, tag=f"dp2-{r}", **kw),
        "trainer",
        lambda r: run_trainer(b.tmp, b.world, tag=f"dp2-{r}", **kw),
    )
    o_tps = pooled(ours, "tokens_per_s")
    h_tps = pooled(hf, "tokens_per_s")
    h_cycle_tps = hf[0]["tokens_per_step"] / pooled(hf, "cycle_times")
    ratio = o_tps / h_tps
    trainer = {"tokens_per_s": h_tps, "step_time_s": pooled(hf, "step_times"), "tokens_per_s_full_cycle": h_cycle_tps}
    trainer.update({k: hf[0][k] for k in ("optimizer", "optim", "wrapped")}, runs=hf)
    part = {
        "ours": {"tokens_per_s": o_tps, "step_time_s": pooled(ours, "step_times"), "runs": ours},
        "trainer": trainer,
        "ratio": ratio,
        "ratio_vs_full_cycle": o_tps / h_cycle_tps,
        "goal": 1.05,
        "met": ratio >= 1.05,
    }
    b.results["part2_dp2"] = part
    b.rows.append(
        row(
            "tokens/s, dp=2 vs HF Trainer DDP (begin->end)",
            fmt(o_tps, "tps"),
            fmt(h_tps, "tps"),
            fmt(ratio, "ratio"),
            ">= 1.05x",
            verdict(ratio >= 1.05),
        )
    )
    b.rows.append(
        row(
            "  info: same, Trainer full step cycle",
            fmt(o_tps, "tps"),
            fmt(h_cycle_tps, "tps"),
            fmt(o_tps / h_cycle_tps, "ratio"),
        )
    )
    note = (
        f"part 2: Trainer ran {trainer['wrapped']} with {trainer['optimizer']} "
        f"(optim={trainer['optim']}); step time ours {part['ours']['step_time_s']:.3f}s vs "
        f"Trainer {trainer['step_time_s']:.3f}s (begin->end)"
    )
    cross_checks(b, "part 2", part, (ours, hf, "Trainer"), note)


# --------------------------------------------------------------------------------------------
# part 3: pipeline bubble


def part3_synthetic(b: Bench, part: dict, pipe_kw: dict) -> None:
    grains = [GRAIN] + ([] if b.quick else [FINE_GRAIN])
    cases = [dict(pp=pp, m=2 * pp, mbs=2 * (2 * pp), tf=tf, tb=tb) for tf, tb in grains for pp in (2, 4)]
    log(
        "part 3: pipeline bubble with sleep stages through PipelineRunner (1F1B), one 4-rank launch: "
        + ", ".join(f"pp={c['pp']} m={c['m']} tf/tb={c['tf'] * 1e3:.0f}/{c['tb'] * 1e3:.0f} ms" for c in cases)
    )
    for res in run_pipe(b.tmp, mode="synthetic", cases=cases, steps=b.pipe_steps, warmup=b.warmup, **pipe_kw):
        primary = (res["tf_s"], res["tb_s"]) == GRAIN
        res["ratio"] = res["measured_max"] / res["formula"]
        res["met"] = res["ratio"] <= 1.10 if primary else None
        part["synthetic"].append(res)
        b.rows.append(
            row(
                (
                    ("" if primary else "  info: ") + f"bubble pp={res['pp']} m={res['m']} 1F1B, sleep stages "
                    f"{res['tf_s'] * 1e3:.0f}/{res['tb_s'] * 1e3:.0f} ms"
                ),
                fmt(res["measured_max"], "frac"),
                fmt(res["formula"], "frac") + " formula",
                fmt(res["ratio"], "ratio"),
                "<= 1.10x" if primary else "info",
                verdict(res["met"]),
            )
        )


def part3_real(b: Bench, part: dict, pipe_kw: dict) -> None:
    for pp in (2, 4):
        m = 2 * pp
        log(f"part 3: pipeline bubble with the real Llama stages of build_engine, pp={pp}, m={m}")
        job = write_job(
            b.tmp / f"pipe-real-pp{pp}", b.world, dp=1, pp=pp, mbs=2 * m, steps=b.pipe_steps, num_microbatches=m
        )
        (res,) = run_pipe(
            b.tmp,
            mode="real",
            cases=[dict(pp=pp, m=m, mbs=2 * m)],
            steps=b.pipe_steps,
            warmup=b.warmup,
            job=job,
            **pipe_kw,
        )
        res["ratio"] = res["measured_max"] / res["formula"]
        res["ratio_vs_predicted"] = res["measured_max"] / res["predicted_max"]
        part["real"].append(res)
        crowded = pp > (os.cpu_count() or 1)
        b.rows.append(
            row(
                f"  info: bubble pp={pp} m={m} 1F1B, real Llama stages"
                + (f" ({pp} ranks/{os.cpu_count()} cores)" if crowded else ""),
                fmt(res["measured_max"], "frac"),
                f"{res['formula']:.3f} formula, {res['predicted_max']:.3f} w/ imbalance",
                f"{res['ratio']:.2f}x, {res['ratio_vs_predicted']:.2f}x",
            )
        )


def part3(b: Bench) -> None:
    part = {"synthetic": [], "real": []}
    pipe_kw = dict(hidden=MODEL_SHAPE["hidden_size"], block_size=BLOCK_SIZE, seed=SEED)
    part3_synthetic(b, part, pipe_kw)
    if b.real_stages:
        part3_real(b, part, pipe_kw)
    b.results["part3_pipeline_bubble"] = part
    for res in part["synthetic"] + part["real"]:
        what = (
            f"sleep {res['tf_s'] * 1e3:.0f}/{res['tb_s'] * 1e3:.0f} ms" if res["mode"] == "synthetic" else "real Llama"
        )
        per = ", ".join(
            f"r{x['rank']} {x['busy_s'] * 1e3:.0f}/{x['wall_s'] * 1e3:.0f} ms -> {x['bubble']:.3f}"
            for x in res["ranks"]
        )
        b.notes.append(
            f"part 3 {what} pp={res['pp']} m={res['m']}: busy/wall per rank: {per}; schedule overhead "
            f"beyond ideal 1F1B with these stage times: {res['excess_per_step_s'] * 1e3:.0f} ms/step"
        )
    b.notes.append(
        "part 3 method: busy = time inside PipelineStage.forward_one_chunk/backward_one_chunk and the "
        "runner's loss function; wall = PipelineRunner.step (its loss all-reduce included) after a barrier; "
        "bubble = 1 - busy/wall, median of steady steps, worst rank shown. Sleep stages use no CPU, so "
        "4 ranks on 2 cores do not contend; they are balanced and fixed, so stage imbalance and "
        "compute/communication contention are not in the goal rows. The overhead beyond the formula is "
        "a roughly fixed number of ms per step (p2p latency, process wake-ups on a loaded machine, the "
        "loss all-reduce), so the ratio grows as stages get shorter (compare the two stage lengths)."
    )


# --------------------------------------------------------------------------------------------
# part 4: MFU


def part4(b: Bench) -> None:
    import torch

    if not torch.cuda.is_available():
        b.results["part4_mfu"] = {"skipped": "no CUDA device"}
        b.rows.append(row("MFU ~1B Llama bf16, 1 GPU", "skipped", "(no CUDA device)", "-"))
        return
    log("part 4: MFU of a ~1B Llama on one CUDA device")
    try:
        mfu = run_mfu("cuda", seed=SEED, betas=BETAS, max_grad_norm=MAX_GRAD_NORM)
        b.results["part4_mfu"] = mfu
        b.rows.append(
            row(
                f"MFU ~1B Llama bf16, 1 GPU ({mfu['device']})",
                fmt(mfu["mfu"], "pct") if mfu["mfu"] is not None else f"{mfu['achieved_tflops']:.0f} TFLOP/s",
                f"peak {mfu['peak_tflops']:.0f} TFLOP/s" if mfu["peak_tflops"] else "peak unknown",
                f"{mfu['tokens_per_s']:,.0f} tok/s",
            )
        )
    except Exception as exc:  # a GPU-side failure must not hide the CPU results
        b.results["part4_mfu"] = {"error": repr(exc)}
        b.rows.append(row("MFU ~1B Llama bf16, 1 GPU", "error", "-", "-"))
        b.notes.append(f"part 4 failed: {exc!r}")


# --------------------------------------------------------------------------------------------
# command line


def parse_args() -> argparse.Namespace:
    ap = parser(__doc__, "8 steps a run, one round, one pipeline stage length")
    ap.add_argument(
        "--steps",
        type=int,
        default=None,
        help="optimizer steps per timed run, warm-up included (default 40; --quick 8)",
    )
    ap.add_argument("--warmup", type=int, default=None, help="leading steps skipped in every run")
    ap.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="alternating ours/baseline rounds, parts 1 and 2 (default 3; --quick 1)",
    )
    ap.add_argument("--mbs", type=int, default=8, help="micro batch (sequences per rank) of the 1-rank runs")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="OMP_NUM_THREADS of the 1-rank runs (default 1, the launcher's default: on a shared 2-core "
        "machine two OpenMP threads per process spin against other load and run several times slower)",
    )
    ap.add_argument(
        "--real-stages",
        action="store_true",
        help="also measure the bubble of the real Llama stages at pp=2 and pp=4 (info rows; about a "
        "minute more; on a shared 2-core machine indicative only)",
    )
    ap.add_argument("--out", default=str(RESULTS / "train_throughput.json"), help="where the JSON results go")
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: 1,2,3,4")
    ap.add_argument("--_worker", choices=["plain"], help=argparse.SUPPRESS)
    ap.add_argument("--_cfg", help=argparse.SUPPRESS)
    return ap.parse_args()


def config(b: Bench) -> dict:
    import torch

    return {
        "quick": b.quick,
        "steps": b.steps,
        "warmup": b.warmup,
        "rounds": b.rounds,
        "block_size": BLOCK_SIZE,
        "model_shape": MODEL_SHAPE,
        "mbs_1rank": b.mbs1,
        "mbs_dp2_per_rank": b.mbs2,
        "threads_1rank": b.threads,
        "lr": LR,
        "betas": BETAS,
        "max_grad_norm": MAX_GRAD_NORM,
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "loadavg_start": loadavg(),
    }


def report(b: Bench, out: Path) -> None:
    import torch

    print()
    print(
        f"neuron_parallel training throughput ({'quick' if b.quick else 'full'}: {b.steps} steps/run, "
        f"{b.warmup} warm-up skipped, {b.rounds} round(s); torch {torch.__version__}, {os.cpu_count()} CPU cores; "
        f"load avg {b.results['config']['loadavg_start']} -> {b.results['config']['loadavg_end']})"
    )
    print_table(b.rows)
    for n in b.notes:
        print(" - " + n)
    print(f"total {b.results['total_wall_s']:.0f} s")
    write_results(out, b.results)


def main() -> int:
    args = parse_args()
    if args._worker:
        cfg = json.loads(Path(args._cfg).read_text())
        worker_plain(cfg)
        return 0

    steps = args.steps or (8 if args.quick else 40)
    warmup = args.warmup if args.warmup is not None else (2 if args.quick else 3)
    if steps <= warmup + 1:
        raise SystemExit(f"--steps must exceed the {warmup} warm-up steps by at least 2")
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    b = Bench(
        quick=args.quick,
        real_stages=args.real_stages,
        steps=steps,
        warmup=warmup,
        rounds=args.rounds or (1 if args.quick else 3),
        threads=args.threads,
        mbs1=args.mbs,
        mbs2=max(1, args.mbs // 2),  # dp=2: the same global batch as the 1-rank runs
        pipe_steps=min(steps, 10),
    )
    import torch  # noqa: F401  (imported before the clock starts, as the parts use it)

    t_all = time.perf_counter()
    b.results["config"] = config(b)
    with tempfile.TemporaryDirectory(prefix="np-bench-") as tmp_s:
        b.tmp = Path(tmp_s)
        log(f"building the tiny world (shape {MODEL_SHAPE}, block {BLOCK_SIZE}) in {b.tmp}")
        b.world = build_world(b.tmp)
        b.results["config"]["num_blocks"] = b.world["num_blocks"]
        for name, run in (("1", part1), ("2", part2), ("3", part3), ("4", part4)):
            if name not in skip:
                run(b)

    b.results["config"]["loadavg_end"] = loadavg()
    b.results["total_wall_s"] = time.perf_counter() - t_all
    b.results["table"] = b.rows
    b.results["notes"] = b.notes
    report(b, Path(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
