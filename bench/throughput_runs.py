"""The timed runs of ``train_throughput.py`` (parts 1 and 2), each in its own process: the tiny
Llama world and the job files, neuron_parallel through its entry point, the plain transformers +
``torch.optim.AdamW`` loop (whose worker ``train_throughput.py --_worker plain`` runs), HF
``Trainer`` with DDP (``hf_trainer_ddp.py`` under torchrun), and the ours/baseline alternation
over rounds. The model shape and the optimizer settings all runs share are defined here."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

# bench/ is on sys.path (the running script's folder)
from bench_util import log, run_child, run_ranks_child

from neuron_parallel.checkpoint.output import claim_run_dir

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
            # Every step logs: a row (with its own step_time_s) is written only at a step that
            # logs, and the medians and the CpuMonitor need one per step, as it ends.
            log_every=1,
        ),
    )
    claim_run_dir(run_dir)  # a run writes only into a folder the tool claimed, as the launcher does
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

    from neuron_parallel.batches import BlockStream

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
        batch = stream.batch((step - 1) * mbs, mbs)
        inputs, labels = batch.inputs, batch.labels
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


def run_cfg(world: dict, mbs: int, steps: int, **paths: str) -> dict:
    """What a baseline's worker reads: the world, the batch, the job's optimizer settings, its paths."""
    return dict(
        model=world["model"],
        dataset=world["dataset"],
        seed=SEED,
        lr=LR,
        betas=BETAS,
        mbs=mbs,
        steps=steps,
        max_grad_norm=MAX_GRAD_NORM,
        **paths,
    )


def run_plain(tmp: Path, world: dict, *, threads: int, mbs: int, steps: int, warmup: int, tag: str) -> dict:
    out = tmp / f"plain-{tag}.json"
    lines = tmp / f"plain-{tag}.steps.jsonl"
    lines.unlink(missing_ok=True)
    cfg = run_cfg(
        world,
        mbs,
        steps,
        out=str(out),
        lines=str(lines),
    )
    cfg_path = tmp / f"plain-{tag}.cfg.json"
    cfg_path.write_text(json.dumps(cfg))
    wall, mon = run_child(
        [
            sys.executable,
            str(Path(__file__).resolve().with_name("train_throughput.py")),
            "--_worker",
            "plain",
            "--_cfg",
            str(cfg_path),
        ],
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
    cfg = run_cfg(
        world,
        mbs,
        steps,
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
# parts 1 and 2: ours and the baseline alternate over rounds


def alternate(
    part: str, rounds: int, what: str, ours: Callable[[int], dict], base_name: str, base: Callable[[int], dict]
) -> tuple[list[dict], list[dict]]:
    """Run ours and the baseline in turns (ours, base, base, ours, ...); ``what`` describes a run in
    the log, and each callable takes the round index. Returns (our runs, the baseline's runs)."""
    got: dict[str, list[dict]] = {"ours": [], base_name: []}
    run = {"ours": ours, base_name: base}
    for r in range(rounds):
        order = ("ours", base_name) if r % 2 == 0 else (base_name, "ours")
        for who in order:
            log(f"part {part}, round {r + 1}/{rounds}: {who} ({what})")
            got[who].append(run[who](r))
    return got["ours"], got[base_name]
