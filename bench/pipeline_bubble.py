"""Part 3 of ``train_throughput.py``: the pipeline bubble, pp=2 and pp=4, 1F1B, m = 2p
microbatches, against ``(p-1)/(m+p-1)``.

The real ``neuron_parallel.parallel.pipeline.PipelineRunner`` (``PipelineStage`` + ``Schedule1F1B`` over
gloo) drives stage modules whose forward and backward sleep a fixed time (a ``Linear`` and an
autograd function sleeping ``tf`` forward, ``tb`` = 2 tf backward; activations of 2 x 128 x 256
floats cross the stages). Each rank's busy time is measured by wrapping the stage's
``forward_one_chunk``/``backward_one_chunk`` and the runner's loss function with timers; a
barrier starts every step together; the step's wall time is that of ``PipelineRunner.step``
(its final loss all-reduce included). Bubble = 1 - busy/wall per rank, median over steady
steps; the worst rank is shown. Sleeping stages use no CPU, so 4 ranks on 2 cores do not
contend, and the number isolates what the schedule adds: waiting for neighbours, p2p
latency, Python scheduling and wake-ups. Limits: the stages are perfectly balanced and fixed,
so stage imbalance and compute/communication contention are not in it; what the schedule adds
is a roughly fixed number of milliseconds per step, so the ratio to the formula depends on the
stage length: the goal rows use 50/100 ms (a realistic stage time for real models), and the
full run also shows 20/40 ms. ``--real-stages`` adds info rows measured the same way on the
real Llama stages of ``neuron_parallel.engine.build_engine``: those are unbalanced (the last
stage holds the lm_head and the loss), which the formula ignores, so they are also compared
with the 1F1B prediction from the measured stage times, ``1 - m t_r / (sum_s t_s + (m-1)
max_s t_s)``; real compute on a loaded 2-core machine (and 4 ranks at pp=4) makes them
indicative only.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from bench_util import median, run_ranks_child  # bench/ is on sys.path

# Sleep-stage durations (forward, backward): the goal rows, and a finer grain shown for its
# sensitivity to the fixed per-step overhead.
GRAIN = (0.05, 0.10)
FINE_GRAIN = (0.02, 0.04)


def _timed(fn, acc: list[float]):
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[0] += time.perf_counter() - t

    return wrapper


def _instrument(runner) -> list[float]:
    """Accumulate this rank's compute time: stage forward, stage backward, loss (last stage)."""
    busy = [0.0]
    stage = runner.pipeline_stages[0]
    stage.forward_one_chunk = _timed(stage.forward_one_chunk, busy)
    stage.backward_one_chunk = _timed(stage.backward_one_chunk, busy)
    runner.loss_fn = _timed(runner.loss_fn, busy)  # PipelineRunner calls it for every microbatch
    return busy


def _sleep_stage(hidden: int, tf: float, tb: float):
    """A fixed-duration stage: ``tf`` seconds forward, ``tb`` seconds backward, plus a Linear so
    there are parameters and activations of a realistic size to send and receive."""
    import torch
    import torch.nn as nn

    class Sleep(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            time.sleep(tf)
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            time.sleep(tb)
            return grad

    class SleepStage(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(hidden, hidden)

        def forward(self, x):
            return Sleep.apply(self.proj(x))

    return SleepStage()


def worker_pipe(cfg: dict) -> None:
    """One pp rank. ``synthetic``: every case of ``cfg["cases"]`` in turn on the first ``pp`` ranks
    of the world (a subgroup), the others waiting. ``real``: the Llama stages of ``cfg["job"]``
    built by ``build_engine`` on a world of exactly ``pp`` ranks."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    from neuron_parallel.parallel.pipeline import PipelineRunner

    steps = cfg["steps"]
    results = []
    if cfg["mode"] == "synthetic":
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        for case in cfg["cases"]:
            p, m, mbs = case["pp"], case["m"], case["mbs"]
            group = dist.new_group(list(range(p)))  # every rank takes part in creating it
            records = None
            if rank < p:
                torch.manual_seed(0)
                module = _sleep_stage(cfg["hidden"], case["tf"], case["tb"])
                runner = PipelineRunner(
                    [module],
                    [rank],
                    p,
                    pp_group=group,
                    device=torch.device("cpu"),
                    schedule="1f1b",
                    num_microbatches=m,
                    loss_fn=lambda out, target: (out.float().mean(-1) - target).pow(2).mean(),
                )
                busy = _instrument(runner)
                x = torch.randn(mbs, cfg["block_size"], cfg["hidden"])
                target = torch.zeros(mbs, cfg["block_size"])
                records = []
                for step in range(1, steps + 1):
                    dist.barrier(group=group)
                    busy[0] = 0.0
                    t0 = time.perf_counter()
                    runner.step(x if rank == 0 else None, target)
                    records.append({"step": step, "wall": time.perf_counter() - t0, "busy": busy[0]})
                    for prm in module.parameters():
                        prm.grad = None
            dist.barrier()
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, records)
            results.append({**case, "per_rank": gathered[:p]})
    else:
        from neuron_parallel.batches import BlockStream
        from neuron_parallel.config import JobConfig
        from neuron_parallel.engine import build_engine
        from neuron_parallel.mesh import ParallelDims, init_distributed, local_device

        (case,) = cfg["cases"]
        p, mbs = case["pp"], case["mbs"]
        job = JobConfig.load(cfg["job"])
        init_distributed("cpu")
        rank = dist.get_rank()
        torch.manual_seed(cfg["seed"])
        engine = build_engine(job, ParallelDims(dp=1, pp=p, tp=1), local_device("cpu"))
        busy = _instrument(engine.runner)
        stream = BlockStream(job.dataset_path, seed=cfg["seed"])
        records = []
        for step in range(1, steps + 1):
            batch = stream.batch((step - 1) * mbs, mbs)
            dist.barrier()
            busy[0] = 0.0
            t0 = time.perf_counter()
            engine.forward_backward(batch, 1.0)  # PipelineRunner.step: the 1F1B schedule
            records.append({"step": step, "wall": time.perf_counter() - t0, "busy": busy[0]})
            engine.reduce_and_clip()
            engine.optimizer_step(job.train.lr)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, records)
        results.append({**case, "per_rank": gathered})
    if rank == 0:
        from neuron_parallel.testing.ranks import print_rank_result

        print_rank_result({"rank": rank, "cases": results})
    from neuron_parallel.mesh import close_distributed

    close_distributed()


def summarize_pipe(case: dict, warmup: int) -> dict:
    """Per rank: median over steady steps of wall, busy and 1 - busy/wall; the formula; and the
    1F1B step predicted from the measured per-stage time (imbalance and overshoot included)."""
    p, m = case["pp"], case["m"]
    ranks = []
    for r, recs in enumerate(case["per_rank"]):
        steady = [x for x in recs if x["step"] > warmup]
        ranks.append(
            {
                "rank": r,
                "wall_s": median([x["wall"] for x in steady]),
                "busy_s": median([x["busy"] for x in steady]),
                "bubble": median([1.0 - x["busy"] / x["wall"] for x in steady]),
                "per_step": [[round(x["busy"], 4), round(x["wall"], 4)] for x in steady],
            }
        )
    t = [x["busy_s"] / m for x in ranks]  # per-microbatch forward+backward time of each stage
    predicted_step = sum(t) + (m - 1) * max(t)
    wall = max(x["wall_s"] for x in ranks)
    return {
        "pp": p,
        "m": m,
        "mbs": case["mbs"],
        "tf_s": case.get("tf"),
        "tb_s": case.get("tb"),
        "ranks": ranks,
        "measured_max": max(x["bubble"] for x in ranks),
        "measured_first_stage": ranks[0]["bubble"],
        "formula": (p - 1) / (m + p - 1),
        "predicted_max": max(1.0 - m * tr / predicted_step for tr in t),
        # What the schedule adds beyond ideal 1F1B with these stage times (p2p latency, wake-ups,
        # the final loss all-reduce), in seconds per step.
        "excess_per_step_s": wall - predicted_step,
    }


def run_pipe(
    tmp: Path,
    *,
    mode: str,
    cases: list[dict],
    steps: int,
    warmup: int,
    hidden: int,
    block_size: int,
    seed: int,
    job: Path | None = None,
) -> list[dict]:
    """Every case in one launch of ``max(pp)`` ranks (``run_ranks_child``: torchrun); ``job`` (a job.json)
    for ``real``. Rank 0 reports the gathered per-rank records with ``print_rank_result``."""
    tag = f"{mode}-" + "-".join(f"pp{c['pp']}m{c['m']}t{int(1e3 * c.get('tf', 0))}" for c in cases)
    nproc = max(c["pp"] for c in cases)
    cfg = dict(
        mode=mode,
        cases=cases,
        steps=steps,
        hidden=hidden,
        block_size=block_size,
        seed=seed,
        job=str(job) if job else None,
    )
    cfg_path = tmp / f"pipe-{tag}.cfg.json"
    cfg_path.write_text(json.dumps(cfg))
    run, _ = run_ranks_child(
        Path(__file__).resolve(),
        nproc,
        [str(cfg_path)],
        threads=1,
        timeout=900,
        label=f"pipeline {tag}",
    )
    (report,) = run.by_rank[0]
    return [{"mode": mode, **summarize_pipe(case, warmup)} for case in report["cases"]]


if __name__ == "__main__":  # a pp rank under torchrun, started by run_pipe through run_ranks
    worker_pipe(json.loads(Path(sys.argv[1]).read_text()))
