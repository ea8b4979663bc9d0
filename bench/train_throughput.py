"""Training-throughput benchmark of neuron_parallel against baselines measured in the same run.

    .venv/bin/python bench/train_throughput.py [--quick] [--steps N] [--real-stages]

Everything runs on a tiny Llama world built in a temporary directory
(``neuron_parallel.tiny.make_tiny_world`` widened to hidden 256 / intermediate 704 so that matmuls
dominate the step) and its pydoc corpus packed by ``neuron_parallel.data.tokenize_dataset`` into
rows of 128 + 1 tokens. Every timed run is its own process. The results are printed as one table
(metric, ours, baseline, ratio, goal, met?) and written to ``bench/results/train_throughput.json``.
Nothing is hard-coded: every number is measured in this invocation.

1. One rank. neuron_parallel through its real entry point, launched by the project's launcher
   ``neuron_parallel.launch.run_ranks`` (``torchrun --standalone --nproc_per_node 1 -m
   neuron_parallel.train job.json``), read from the
   run's ``metrics.jsonl`` (``tokens_per_s``, ``step_time_s``; warm-up steps skipped; median),
   against a plain loop in its own process: ``AutoModelForCausalLM.from_pretrained`` of the same
   directory, the same batches from ``BlockStream`` (same seed, same sample positions), the same
   micro batch, next-token cross entropy over all positions (the HF loss with ``shift_labels``),
   ``torch.nn.utils.clip_grad_norm_`` at the job's max norm (ours clips too), and
   ``torch.optim.AdamW`` in its default implementation with the job's lr/betas/eps/weight decay,
   so both runs must follow the same loss curve: the largest loss difference is printed as proof
   that they did the same work. The plain loop times a step as ``train.py`` does (data fetch to
   ``loss.item()``) with ``torch.set_num_threads`` = the rank's ``OMP_NUM_THREADS`` (default 1,
   the launcher's default; on a shared 2-core machine two OpenMP threads per process spin against
   other load and run several times slower, so 2 threads measure the neighbours, not the code).
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
import math
import os
import sys
import tempfile
import time
from pathlib import Path

# bench/ is the script's own directory, first on sys.path
from bench_util import ROOT, loadavg, log, median, run_child, run_ranks_child
from mfu import run_mfu
from pipeline_bubble import FINE_GRAIN, GRAIN, run_pipe

RESULTS = ROOT / "bench" / "results" / "train_throughput.json"

# A wider tiny Llama than the test default (hidden 128), so matmuls dominate the step.
MODEL_SHAPE = dict(
    hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2
)
BLOCK_SIZE = 128
SEED = 0
LR = 1e-3
BETAS = (0.9, 0.95)
MAX_GRAD_NORM = 1.0


# --------------------------------------------------------------------------------------------
# setup


def build_world(tmp: Path) -> dict:
    from neuron_parallel.data import tokenize_dataset
    from neuron_parallel.tiny import make_tiny_world

    try:
        import datasets
        import transformers

        datasets.disable_progress_bars()
        transformers.utils.logging.disable_progress_bar()
    except Exception:
        pass
    world = make_tiny_world(tmp / "world", seed=SEED, **MODEL_SHAPE)
    ds = tokenize_dataset(
        source=world["corpus"], tokenizer_dir=world["model"], block_size=BLOCK_SIZE, cache_dir=tmp / "datasets"
    )
    return {"model": world["model"], "dataset": ds.path, "num_blocks": ds.num_blocks}


def write_job(
    run_dir: Path,
    world: dict,
    *,
    dp: int,
    pp: int = 1,
    mbs: int,
    steps: int,
    num_microbatches: int = 1,
    schedule: str = "1f1b",
) -> Path:
    from neuron_parallel.config import DataConfig, JobConfig, ParallelConfig, TrainConfig

    job = JobConfig(
        model_path=world["model"],
        dataset_path=world["dataset"],
        output_dir=str(run_dir),
        data=DataConfig(block_size=BLOCK_SIZE),
        parallel=ParallelConfig(dp=dp, pp=pp, num_microbatches=num_microbatches, pipeline_schedule=schedule),
        train=TrainConfig(
            max_steps=steps,
            save_every=0,
            keep_checkpoints=1,
            seed=SEED,
            global_batch_size=mbs * dp,  # no gradient accumulation: one micro batch per rank and step
            micro_batch_size=mbs,
            lr=LR,
            lr_schedule="constant",
            warmup_steps=0,
            weight_decay=0.0,
            betas=BETAS,
            max_grad_norm=MAX_GRAD_NORM,
            log_every=max(1, steps),
        ),
    )
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "job.json"
    path.write_text(job.to_json())
    return path


# --------------------------------------------------------------------------------------------
# part 1 and 2: neuron_parallel through its entry point


def run_ours(tmp: Path, world: dict, *, nproc: int, threads: int, mbs: int, steps: int, warmup: int, tag: str) -> dict:
    run_dir = tmp / f"ours-{tag}"
    job = write_job(run_dir, world, dp=nproc, mbs=mbs, steps=steps)
    run, mon = run_ranks_child(
        "neuron_parallel.train",
        nproc,
        [str(job)],
        threads=threads,
        timeout=900,
        label=f"neuron_parallel.train ({tag})",
        monitor=(run_dir / "metrics.jsonl", "neuron_parallel.train", nproc),
    )
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steady = [r for r in rows if r["step"] > warmup]
    return {
        "step_times": [r["step_time_s"] for r in steady],
        "tokens_per_s": [r["tokens_per_s"] for r in steady],
        "losses": [r["loss"] for r in rows],
        "tokens_per_step": mbs * nproc * BLOCK_SIZE,
        "sched": mon.per_step(warmup, steps) if mon else None,
        "process_wall_s": run.seconds,
    }


# --------------------------------------------------------------------------------------------
# part 1 baseline: plain transformers + torch.optim.AdamW (worker, runs in its own process)


def worker_plain(cfg: dict) -> None:
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    from transformers import AutoModelForCausalLM

    from neuron_parallel.data import BlockStream

    torch.manual_seed(cfg["seed"])
    stream = BlockStream(cfg["dataset"], seed=cfg["seed"])
    model = AutoModelForCausalLM.from_pretrained(cfg["model"])
    model.train()
    # torch's default AdamW implementation (foreach=None: the per-tensor loop on CPU), with the
    # hyper-parameters of the job so that both runs follow the same loss curve.
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], betas=tuple(cfg["betas"]), eps=1e-8, weight_decay=0.0)
    mbs, out = cfg["mbs"], []
    lines = open(cfg["lines"], "a")  # one line per step, as train.py appends to metrics.jsonl
    for step in range(1, cfg["steps"] + 1):
        t0 = time.perf_counter()
        torch.manual_seed(cfg["seed"] * 100_003 + step)
        inputs, labels = stream.batch((step - 1) * mbs, mbs)
        loss = model(input_ids=inputs, labels=labels, shift_labels=labels).loss  # CE over all positions
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["max_grad_norm"])
        opt.step()
        opt.zero_grad(set_to_none=True)
        value = loss.item()
        out.append({"step": step, "loss": value, "step_time_s": time.perf_counter() - t0})
        lines.write(json.dumps(out[-1]) + "\n")
        lines.flush()
    Path(cfg["out"]).write_text(
        json.dumps(
            {
                "steps": out,
                "threads": torch.get_num_threads(),
                "foreach": opt.defaults.get("foreach"),
                "attn": model.config._attn_implementation,
            }
        )
    )


def run_plain(tmp: Path, world: dict, *, threads: int, mbs: int, steps: int, warmup: int, tag: str) -> dict:
    out = tmp / f"plain-{tag}.json"
    lines = tmp / f"plain-{tag}.steps.jsonl"
    lines.unlink(missing_ok=True)
    cfg = dict(
        model=world["model"],
        dataset=world["dataset"],
        seed=SEED,
        lr=LR,
        betas=BETAS,
        mbs=mbs,
        steps=steps,
        max_grad_norm=MAX_GRAD_NORM,
        out=str(out),
        lines=str(lines),
    )
    cfg_path = tmp / f"plain-{tag}.cfg.json"
    cfg_path.write_text(json.dumps(cfg))
    wall, mon = run_child(
        [sys.executable, str(Path(__file__).resolve()), "--_worker", "plain", "--_cfg", str(cfg_path)],
        threads=threads,
        timeout=900,
        label=f"plain loop ({tag})",
        monitor=(lines, "--_worker", 1),
    )
    res = json.loads(out.read_text())
    steady = [r for r in res["steps"] if r["step"] > warmup]
    tokens = mbs * BLOCK_SIZE
    return {
        "step_times": [r["step_time_s"] for r in steady],
        "tokens_per_s": [tokens / r["step_time_s"] for r in steady],
        "losses": [r["loss"] for r in res["steps"]],
        "tokens_per_step": tokens,
        "sched": mon.per_step(warmup, steps) if mon else None,
        "threads": res["threads"],
        "attn_implementation": res["attn"],
        "process_wall_s": wall,
    }


# --------------------------------------------------------------------------------------------
# part 2 baseline: transformers.Trainer with DDP (hf_trainer_ddp.py under torchrun)


def trainer_deps(tmp: Path) -> tuple[str | None, str]:
    """``transformers.Trainer`` needs ``accelerate``, which the project's ``bench`` extra installs
    (``pip install -e '.[bench]'``). Returns (extra PYTHONPATH entry, how it was satisfied)."""
    import importlib.util

    if importlib.util.find_spec("accelerate") is None:
        raise RuntimeError("transformers.Trainer needs accelerate; install the bench extra: pip install -e '.[bench]'")
    return None, "accelerate from the venv"


def run_trainer(tmp: Path, world: dict, *, nproc: int, mbs: int, steps: int, warmup: int, tag: str) -> dict:
    extra_path, how = trainer_deps(tmp)
    script = Path(__file__).with_name("hf_trainer_ddp.py")
    out = tmp / f"trainer-{tag}.json"
    cfg = dict(
        model=world["model"],
        dataset=world["dataset"],
        seed=SEED,
        lr=LR,
        betas=BETAS,
        mbs=mbs,
        steps=steps,
        max_grad_norm=MAX_GRAD_NORM,
        output_dir=str(tmp / f"trainer-{tag}"),
        out=str(out),
        lines=str(tmp / f"trainer-{tag}.steps.jsonl"),
    )
    Path(cfg["lines"]).unlink(missing_ok=True)
    cfg_path = tmp / f"trainer-{tag}.cfg.json"
    cfg_path.write_text(json.dumps(cfg))
    run, mon = run_ranks_child(
        script,
        nproc,
        [str(cfg_path)],
        threads=1,
        timeout=900,
        label=f"HF Trainer DDP ({tag})",
        extra_path=extra_path,
        monitor=(Path(cfg["lines"]), script.name, nproc),
    )
    res = json.loads(out.read_text())
    begin, end = res["begin"], res["end"]
    n = min(len(begin), len(end))
    # Step k (1-based) is steady when k > warmup.
    inside = [end[k] - begin[k] for k in range(warmup, n)]
    cycle = [begin[k + 1] - begin[k] for k in range(warmup, len(begin) - 1)]
    tokens = mbs * nproc * BLOCK_SIZE
    return {
        "step_times": inside,
        "cycle_times": cycle,
        "tokens_per_s": [tokens / t for t in inside],
        "tokens_per_step": tokens,
        "sched": mon.per_step(warmup, steps) if mon else None,
        "optimizer": res["optimizer"],
        "optim": res["optim"],
        "wrapped": res["wrapped"],
        "accelerate": how,
        "process_wall_s": run.seconds,
    }


# --------------------------------------------------------------------------------------------
# report


def _fmt(x, kind: str) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if kind == "tps":
        return f"{x:,.0f} tok/s"
    if kind == "frac":
        return f"{x:.3f}"
    if kind == "ratio":
        return f"{x:.3f}x"
    if kind == "pct":
        return f"{100 * x:.1f}%"
    return str(x)


def print_table(rows: list[dict]) -> None:
    headers = ["metric", "ours", "baseline", "ratio", "goal", "met?"]
    cells = [headers] + [[r["metric"], r["ours_s"], r["baseline_s"], r["ratio_s"], r["goal"], r["met"]] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(headers))]
    line = "+-" + "-+-".join("-" * w for w in widths) + "-+"
    print(line)
    for i, c in enumerate(cells):
        print("| " + " | ".join(s.ljust(w) for s, w in zip(c, widths)) + " |")
        if i == 0:
            print(line)
    print(line)


def noise_note(notes: list[str], name: str, part: dict) -> None:
    """Say so when other people's load, not the code, decided a wall-clock ratio."""
    own = part.get("own_machine_s")
    if own and abs(part["ratio"] / own["ratio"] - 1) > 0.10:
        notes.append(
            f"{name}: the wall-clock ratio {part['ratio']:.2f}x and the run-queue-corrected {own['ratio']:.2f}x "
            f"differ by more than 10%: background load, not the code, moved the wall-clock number; the "
            f"info rows (and a re-run on an idle machine) are the better guide"
        )


def sched_note(notes: list[str], name: str, ours: list[dict], base: list[dict], base_name: str) -> None:
    def desc(runs):
        got = [r["sched"] for r in runs if r.get("sched")]
        return (
            "n/a"
            if not got
            else ", ".join(
                f"{k} {median([g[k + '_s'] for g in got]):.3f}s" for k in ("wall", "cpu", "queued", "own_machine")
            )
        )

    notes.append(
        f"{name} per step, from the scheduler (median of runs): ours {desc(ours)}; {base_name} {desc(base)} "
        f"(cpu = all threads of all ranks; queued = main threads waiting for a core)"
    )


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def sched_rows(rows: list[dict], part: dict, ours: list[dict], base: list[dict]) -> None:
    """Cross-checks of a wall-clock ratio that other people's load skews less: the 20th percentile
    of the same steps (load here comes in bursts, and the faster steps are the quiet moments), and
    from the scheduler statistics of the same runs, tokens/s with the main threads' run-queue wait
    taken out and tokens per CPU-second (both still inflated by contention for caches and cores)."""
    o_t = ours[0]["tokens_per_step"] / _quantile([x for r in ours for x in r["step_times"]], 0.2)
    b_t = base[0]["tokens_per_step"] / _quantile([x for r in base for x in r["step_times"]], 0.2)
    part["p20_step"] = {"ours": o_t, "baseline": b_t, "ratio": o_t / b_t}
    rows.append(
        dict(
            metric="  info: same steps, 20th-percentile step time",
            ours_s=_fmt(o_t, "tps"),
            baseline_s=_fmt(b_t, "tps"),
            ratio_s=_fmt(o_t / b_t, "ratio"),
            goal="info",
            met="-",
        )
    )
    for key, label, unit in (
        ("own_machine_s", "  info: same runs, wall minus run-queue wait", "tok/s"),
        ("cpu_s", "  info: same runs, tokens per CPU-second", "tok/CPU-s"),
    ):
        o = [r["sched"][key] for r in ours if r.get("sched")]
        b = [r["sched"][key] for r in base if r.get("sched")]
        if not o or not b:
            continue
        o_t, b_t = ours[0]["tokens_per_step"] / median(o), base[0]["tokens_per_step"] / median(b)
        part[key] = {"ours": o_t, "baseline": b_t, "ratio": o_t / b_t}
        rows.append(
            dict(
                metric=label,
                ours_s=f"{o_t:,.0f} {unit}",
                baseline_s=f"{b_t:,.0f} {unit}",
                ratio_s=_fmt(o_t / b_t, "ratio"),
                goal="info",
                met="-",
            )
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps, one round, one pipeline stage length")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps per timed run (warm-up included)")
    ap.add_argument("--warmup", type=int, default=None, help="leading steps skipped in every run")
    ap.add_argument("--rounds", type=int, default=None, help="alternating ours/baseline rounds for parts 1 and 2")
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
    ap.add_argument("--out", default=str(RESULTS), help="where the JSON results go")
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: 1,2,3,4")
    ap.add_argument("--_worker", choices=["plain"], help=argparse.SUPPRESS)
    ap.add_argument("--_cfg", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args._worker:
        cfg = json.loads(Path(args._cfg).read_text())
        worker_plain(cfg)
        return 0

    steps = args.steps or (8 if args.quick else 16)
    warmup = args.warmup if args.warmup is not None else (2 if args.quick else 3)
    if steps <= warmup + 1:
        raise SystemExit(f"--steps must exceed the {warmup} warm-up steps by at least 2")
    rounds = args.rounds or (1 if args.quick else 2)
    threads = args.threads
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    mbs1 = args.mbs
    mbs2 = max(1, mbs1 // 2)  # dp=2: the same global batch as the 1-rank runs
    pipe_steps = min(steps, 10)

    import torch

    t_all = time.perf_counter()
    results: dict = {
        "config": {
            "quick": args.quick,
            "steps": steps,
            "warmup": warmup,
            "rounds": rounds,
            "block_size": BLOCK_SIZE,
            "model_shape": MODEL_SHAPE,
            "mbs_1rank": mbs1,
            "mbs_dp2_per_rank": mbs2,
            "threads_1rank": threads,
            "lr": LR,
            "betas": BETAS,
            "max_grad_norm": MAX_GRAD_NORM,
            "cpu_count": os.cpu_count(),
            "torch": torch.__version__,
            "python": sys.version.split()[0],
            "loadavg_start": loadavg(),
        },
    }
    rows: list[dict] = []
    notes: list[str] = []

    with tempfile.TemporaryDirectory(prefix="np-bench-") as tmp_s:
        tmp = Path(tmp_s)
        log(f"building the tiny world (shape {MODEL_SHAPE}, block {BLOCK_SIZE}) in {tmp}")
        world = build_world(tmp)
        results["config"]["num_blocks"] = world["num_blocks"]

        # ---- part 1: one rank -------------------------------------------------------------
        if "1" not in skip:
            ours, plain = [], []
            for r in range(rounds):
                order = ("ours", "plain") if r % 2 == 0 else ("plain", "ours")
                for who in order:
                    log(f"part 1, round {r + 1}/{rounds}: {who} (1 rank, {threads} threads, mbs {mbs1}, {steps} steps)")
                    if who == "ours":
                        ours.append(
                            run_ours(
                                tmp,
                                world,
                                nproc=1,
                                threads=threads,
                                mbs=mbs1,
                                steps=steps,
                                warmup=warmup,
                                tag=f"1rank-{r}",
                            )
                        )
                    else:
                        plain.append(
                            run_plain(
                                tmp, world, threads=threads, mbs=mbs1, steps=steps, warmup=warmup, tag=f"1rank-{r}"
                            )
                        )
            o_tps = median([x for run in ours for x in run["tokens_per_s"]])
            p_tps = median([x for run in plain for x in run["tokens_per_s"]])
            loss_diff = max(abs(a - b) for a, b in zip(ours[0]["losses"], plain[0]["losses"]))
            ratio = o_tps / p_tps
            part1 = {
                "ours": {
                    "tokens_per_s": o_tps,
                    "step_time_s": median([x for run in ours for x in run["step_times"]]),
                    "runs": ours,
                },
                "plain": {
                    "tokens_per_s": p_tps,
                    "step_time_s": median([x for run in plain for x in run["step_times"]]),
                    "runs": plain,
                },
                "ratio": ratio,
                "goal": 1.00,
                "met": ratio >= 1.00,
                "max_loss_diff": loss_diff,
            }
            results["part1_one_rank"] = part1
            rows.append(
                dict(
                    metric=f"tokens/s, 1 rank ({threads} thr) vs plain HF+AdamW",
                    ours_s=_fmt(o_tps, "tps"),
                    baseline_s=_fmt(p_tps, "tps"),
                    ratio_s=_fmt(ratio, "ratio"),
                    goal=">= 1.00x",
                    met="yes" if ratio >= 1.00 else "NO",
                )
            )
            sched_rows(rows, part1, ours, plain)
            notes.append(
                f"part 1: step time ours {part1['ours']['step_time_s']:.3f}s vs plain "
                f"{part1['plain']['step_time_s']:.3f}s (median of {len(ours) * (steps - warmup)} steps each); "
                f"largest loss difference over {steps} steps = {loss_diff:.2e} (same batches, same updates)"
            )
            sched_note(notes, "part 1", ours, plain, "plain")
            noise_note(notes, "part 1", part1)

        # ---- part 2: dp=2 vs HF Trainer DDP -----------------------------------------------
        if "2" not in skip:
            ours, hf = [], []
            for r in range(rounds):
                order = ("ours", "trainer") if r % 2 == 0 else ("trainer", "ours")
                for who in order:
                    log(f"part 2, round {r + 1}/{rounds}: {who} (2 ranks x 1 thread, mbs {mbs2}/rank, {steps} steps)")
                    if who == "ours":
                        ours.append(
                            run_ours(
                                tmp, world, nproc=2, threads=1, mbs=mbs2, steps=steps, warmup=warmup, tag=f"dp2-{r}"
                            )
                        )
                    else:
                        hf.append(
                            run_trainer(tmp, world, nproc=2, mbs=mbs2, steps=steps, warmup=warmup, tag=f"dp2-{r}")
                        )
            o_tps = median([x for run in ours for x in run["tokens_per_s"]])
            h_tps = median([x for run in hf for x in run["tokens_per_s"]])
            tokens = hf[0]["tokens_per_step"]
            h_cycle_tps = tokens / median([x for run in hf for x in run["cycle_times"]])
            ratio = o_tps / h_tps
            part2 = {
                "ours": {
                    "tokens_per_s": o_tps,
                    "step_time_s": median([x for run in ours for x in run["step_times"]]),
                    "runs": ours,
                },
                "trainer": {
                    "tokens_per_s": h_tps,
                    "step_time_s": median([x for run in hf for x in run["step_times"]]),
                    "tokens_per_s_full_cycle": h_cycle_tps,
                    "optimizer": hf[0]["optimizer"],
                    "optim": hf[0]["optim"],
                    "wrapped": hf[0]["wrapped"],
                    "runs": hf,
                },
                "ratio": ratio,
                "ratio_vs_full_cycle": o_tps / h_cycle_tps,
                "goal": 1.05,
                "met": ratio >= 1.05,
            }
            results["part2_dp2"] = part2
            rows.append(
                dict(
                    metric="tokens/s, dp=2 vs HF Trainer DDP (begin->end)",
                    ours_s=_fmt(o_tps, "tps"),
                    baseline_s=_fmt(h_tps, "tps"),
                    ratio_s=_fmt(ratio, "ratio"),
                    goal=">= 1.05x",
                    met="yes" if ratio >= 1.05 else "NO",
                )
            )
            rows.append(
                dict(
                    metric="  info: same, Trainer full step cycle",
                    ours_s=_fmt(o_tps, "tps"),
                    baseline_s=_fmt(h_cycle_tps, "tps"),
                    ratio_s=_fmt(o_tps / h_cycle_tps, "ratio"),
                    goal="info",
                    met="-",
                )
            )
            sched_rows(rows, part2, ours, hf)
            notes.append(
                f"part 2: Trainer ran {part2['trainer']['wrapped']} with {part2['trainer']['optimizer']} "
                f"(optim={part2['trainer']['optim']}); step time ours {part2['ours']['step_time_s']:.3f}s vs "
                f"Trainer {part2['trainer']['step_time_s']:.3f}s (begin->end)"
            )
            sched_note(notes, "part 2", ours, hf, "Trainer")
            noise_note(notes, "part 2", part2)

        # ---- part 3: pipeline bubble --------------------------------------------------------
        if "3" not in skip:
            part3 = {"synthetic": [], "real": []}
            pipe_kw = dict(hidden=MODEL_SHAPE["hidden_size"], block_size=BLOCK_SIZE, seed=SEED)
            grains = [GRAIN] + ([] if args.quick else [FINE_GRAIN])
            cases = [dict(pp=pp, m=2 * pp, mbs=2 * (2 * pp), tf=tf, tb=tb) for tf, tb in grains for pp in (2, 4)]
            log(
                "part 3: pipeline bubble with sleep stages through PipelineRunner (1F1B), one 4-rank launch: "
                + ", ".join(f"pp={c['pp']} m={c['m']} tf/tb={c['tf'] * 1e3:.0f}/{c['tb'] * 1e3:.0f} ms" for c in cases)
            )
            for res in run_pipe(tmp, mode="synthetic", cases=cases, steps=pipe_steps, warmup=warmup, **pipe_kw):
                primary = (res["tf_s"], res["tb_s"]) == GRAIN
                res["ratio"] = res["measured_max"] / res["formula"]
                res["met"] = res["ratio"] <= 1.10 if primary else None
                part3["synthetic"].append(res)
                rows.append(
                    dict(
                        metric=(
                            ("" if primary else "  info: ") + f"bubble pp={res['pp']} m={res['m']} 1F1B, sleep stages "
                            f"{res['tf_s'] * 1e3:.0f}/{res['tb_s'] * 1e3:.0f} ms"
                        ),
                        ours_s=_fmt(res["measured_max"], "frac"),
                        baseline_s=_fmt(res["formula"], "frac") + " formula",
                        ratio_s=_fmt(res["ratio"], "ratio"),
                        goal="<= 1.10x" if primary else "info",
                        met=("yes" if res["met"] else "NO") if primary else "-",
                    )
                )
            if args.real_stages:
                for pp in (2, 4):
                    m = 2 * pp
                    log(f"part 3: pipeline bubble with the real Llama stages of build_engine, pp={pp}, m={m}")
                    job = write_job(
                        tmp / f"pipe-real-pp{pp}", world, dp=1, pp=pp, mbs=2 * m, steps=pipe_steps, num_microbatches=m
                    )
                    (res,) = run_pipe(
                        tmp,
                        mode="real",
                        cases=[dict(pp=pp, m=m, mbs=2 * m)],
                        steps=pipe_steps,
                        warmup=warmup,
                        job=job,
                        **pipe_kw,
                    )
                    res["ratio"] = res["measured_max"] / res["formula"]
                    res["ratio_vs_predicted"] = res["measured_max"] / res["predicted_max"]
                    part3["real"].append(res)
                    crowded = pp > (os.cpu_count() or 1)
                    rows.append(
                        dict(
                            metric=f"  info: bubble pp={pp} m={m} 1F1B, real Llama stages"
                            + (f" ({pp} ranks/{os.cpu_count()} cores)" if crowded else ""),
                            ours_s=_fmt(res["measured_max"], "frac"),
                            baseline_s=f"{res['formula']:.3f} formula, {res['predicted_max']:.3f} w/ imbalance",
                            ratio_s=f"{res['ratio']:.2f}x, {res['ratio_vs_predicted']:.2f}x",
                            goal="info",
                            met="-",
                        )
                    )
            results["part3_pipeline_bubble"] = part3
            for res in part3["synthetic"] + part3["real"]:
                what = (
                    f"sleep {res['tf_s'] * 1e3:.0f}/{res['tb_s'] * 1e3:.0f} ms"
                    if res["mode"] == "synthetic"
                    else "real Llama"
                )
                per = ", ".join(
                    f"r{x['rank']} {x['busy_s'] * 1e3:.0f}/{x['wall_s'] * 1e3:.0f} ms -> {x['bubble']:.3f}"
                    for x in res["ranks"]
                )
                notes.append(
                    f"part 3 {what} pp={res['pp']} m={res['m']}: busy/wall per rank: {per}; schedule overhead "
                    f"beyond ideal 1F1B with these stage times: {res['excess_per_step_s'] * 1e3:.0f} ms/step"
                )
            notes.append(
                "part 3 method: busy = time inside PipelineStage.forward_one_chunk/backward_one_chunk and the "
                "schedule's loss; wall = PipelineRunner.step (its loss all-reduce included) after a barrier; "
                "bubble = 1 - busy/wall, median of steady steps, worst rank shown. Sleep stages use no CPU, so "
                "4 ranks on 2 cores do not contend; they are balanced and fixed, so stage imbalance and "
                "compute/communication contention are not in the goal rows. The overhead beyond the formula is "
                "a roughly fixed number of ms per step (p2p latency, process wake-ups on a loaded machine, the "
                "loss all-reduce), so the ratio grows as stages get shorter (compare the two stage lengths)."
            )

        # ---- part 4: MFU --------------------------------------------------------------------
        if "4" not in skip:
            if torch.cuda.is_available():
                log("part 4: MFU of a ~1B Llama on one CUDA device")
                try:
                    mfu = run_mfu("cuda", seed=SEED, betas=BETAS, max_grad_norm=MAX_GRAD_NORM)
                    results["part4_mfu"] = mfu
                    rows.append(
                        dict(
                            metric=f"MFU ~1B Llama bf16, 1 GPU ({mfu['device']})",
                            ours_s=_fmt(mfu["mfu"], "pct")
                            if mfu["mfu"] is not None
                            else f"{mfu['achieved_tflops']:.0f} TFLOP/s",
                            baseline_s=f"peak {mfu['peak_tflops']:.0f} TFLOP/s"
                            if mfu["peak_tflops"]
                            else "peak unknown",
                            ratio_s=f"{mfu['tokens_per_s']:,.0f} tok/s",
                            goal="info",
                            met="-",
                        )
                    )
                except Exception as exc:  # a GPU-side failure must not hide the CPU results
                    results["part4_mfu"] = {"error": repr(exc)}
                    rows.append(
                        dict(
                            metric="MFU ~1B Llama bf16, 1 GPU",
                            ours_s="error",
                            baseline_s="-",
                            ratio_s="-",
                            goal="info",
                            met="-",
                        )
                    )
                    notes.append(f"part 4 failed: {exc!r}")
            else:
                results["part4_mfu"] = {"skipped": "no CUDA device"}
                rows.append(
                    dict(
                        metric="MFU ~1B Llama bf16, 1 GPU",
                        ours_s="skipped",
                        baseline_s="(no CUDA device)",
                        ratio_s="-",
                        goal="info",
                        met="-",
                    )
                )

    results["config"]["loadavg_end"] = loadavg()
    results["total_wall_s"] = time.perf_counter() - t_all
    results["table"] = rows
    results["notes"] = notes

    print()
    print(
        f"neuron_parallel training throughput ({'quick' if args.quick else 'full'}: {steps} steps/run, "
        f"{warmup} warm-up skipped, {rounds} round(s); torch {torch.__version__}, {os.cpu_count()} CPU cores; "
        f"load avg {results['config']['loadavg_start']} -> {results['config']['loadavg_end']})"
    )
    print_table(rows)
    for n in notes:
        print(" - " + n)
    print(f"total {results['total_wall_s']:.0f} s")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2, default=str))
    print(f"results written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
