"""How long a checkpoint save blocks training: asynchronous vs synchronous, side by side.

    .venv/bin/python bench/checkpoint_save.py [--quick] [--hidden 1024] [--saves 3] [--work-s 20]

One process (a world of one) holds the fp32 parameters of a Llama of width ``--hidden`` and
AdamW state of the same shapes, alternates a stretch of "training" (matmuls, so the writer
thread competes for the CPU as it would) with a save, and records the time each
``CheckpointWriter.save`` call blocked the loop, including any wait for the previous save to
finish. The same loop runs with
``async_save=False`` and ``True``; the ratio of the mean blocked times is the result
(goal <= 0.1x). Each mode's last checkpoint is validated, so both wrote the same complete thing.
``--quick``: width 256, 2 saves, 2 s of compute between them.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from bench_util import parser, pick, print_table, verdict, write_results

from neuron_parallel.checkpoint import CheckpointWriter, validate_checkpoint
from neuron_parallel.checkpoint.shapes import expected_shapes
from neuron_parallel.mesh import init_distributed


def fake_model(model_dir: Path, hidden: int) -> tuple[dict, dict]:
    """A Llama config of the given width in ``model_dir``, random parameters of its shapes and
    AdamW moments of the same shapes (as a training rank would hold them)."""
    from transformers import LlamaConfig

    LlamaConfig(
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=4,
        vocab_size=8192,
    ).save_pretrained(model_dir)
    shapes = expected_shapes(json.loads((model_dir / "config.json").read_text()))
    model = {name: torch.randn(shape) for name, shape in shapes.items()}
    optim = {f"{k}.{s}": torch.randn_like(v) for k, v in model.items() for s in ("exp_avg", "exp_avg_sq")}
    return model, optim


def run(mode_async: bool, run_dir: Path, model_dir: str, model, optim, saves: int, work_s: float) -> dict:
    coords = {"dp_rank": 0, "pp_rank": 0, "tp_rank": 0}
    writer = CheckpointWriter(run_dir, coords=coords, model_dir=model_dir, keep=2, async_save=mode_async)
    a = torch.randn(512, 512)
    blocked = []
    for step in range(1, saves + 1):
        t_end = time.perf_counter() + work_s
        while time.perf_counter() < t_end:  # training keeps the CPU busy between saves
            a = torch.tanh(a @ a.T / 512)
        t0 = time.perf_counter()
        writer.save(step, model=model, optim=optim, parallel={"tp": 1, "pp": 1, "dp": 1}, trainer_state={"step": step})
        blocked.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    writer.wait()
    final_wait = time.perf_counter() - t0
    problems = validate_checkpoint(run_dir / f"checkpoint-{saves}")
    return {
        "blocked_s": blocked,
        "mean_blocked_s": statistics.mean(blocked),
        "final_wait_s": final_wait,
        "valid": not problems,
    }


def main() -> None:
    ap = parser(__doc__, "width 256, 2 saves, 2 s of compute between them")
    ap.add_argument("--hidden", type=int, help="model width (default 1024: ~0.5 GB of fp32 parameters)")
    ap.add_argument("--saves", type=int, help="saves per mode (default 3)")
    ap.add_argument("--work-s", type=float, help="seconds of compute between saves (default 20: longer than a write)")
    args = ap.parse_args()
    args.hidden = pick(args.hidden, args.quick, 256, 1024)
    args.saves = pick(args.saves, args.quick, 2, 3)
    args.work_s = pick(args.work_s, args.quick, 2.0, 20.0)
    torch.set_num_threads(1)
    init_distributed("cpu")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        model, optim = fake_model(model_dir, args.hidden)
        total = sum(t.numel() * t.element_size() for t in [*model.values(), *optim.values()])
        results = {}
        for name, flag in (("sync", False), ("async", True)):
            results[name] = run(flag, Path(tmp) / name, model_dir, model, optim, args.saves, args.work_s)
    ratio = results["async"]["mean_blocked_s"] / results["sync"]["mean_blocked_s"]
    print(
        f"checkpoint of {total / 1e9:.2f} GB ({len(model)} parameters + AdamW state), {args.saves} saves, "
        f"{args.work_s:.0f} s of compute between saves"
    )
    rows = [
        [name, ", ".join(f"{x:.2f}" for x in r["blocked_s"]), f"{r['mean_blocked_s']:.3f}"]
        + [f"{r['final_wait_s']:.2f}", str(r["valid"])]
        for name, r in results.items()
    ]
    print_table(["mode", "blocked per save (s)", "mean", "final wait (s)", "valid"], rows)
    print(f"async / sync blocked time: {ratio:.3f}x (goal <= 0.10x: {verdict(ratio <= 0.10)})")
    write_results("checkpoint_save.json", {"bytes": total, "ratio": ratio, **results})


if __name__ == "__main__":
    main()
