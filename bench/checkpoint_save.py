"""How long a checkpoint save blocks training: asynchronous vs synchronous, side by side.

    python bench/checkpoint_save.py [--hidden 1024] [--saves 3]

One process (a world of one) holds the fp32 parameters of a Llama of width ``--hidden`` and
AdamW state of the same shapes, alternates a stretch of "training" (matmuls, so the writer
thread competes for the CPU as it would) with a save, and records the time each
``CheckpointWriter.save`` call blocked the loop, including any wait for the previous save to
finish. The same loop runs with
``async_save=False`` and ``True``; the ratio of the mean blocked times is the result
(goal <= 0.1x). Each mode's last checkpoint is validated, so both wrote the same complete thing.
"""

from __future__ import annotations

import os
import sys

# bench/tokenize.py shares a name with the standard library's ``tokenize`` (which ``inspect`` and so
# torch import): keep this script's folder, first on sys.path, behind the standard library.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE] + [_HERE]

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from neuron_parallel.checkpoint import CheckpointWriter, validate_checkpoint  # noqa: E402
from neuron_parallel.checkpoint.validate import expected_shapes  # noqa: E402
from neuron_parallel.mesh import init_distributed  # noqa: E402


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
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=1024, help="model width: 1024 gives ~0.5 GB of fp32 parameters")
    ap.add_argument("--saves", type=int, default=3)
    ap.add_argument(
        "--work-s", type=float, default=20.0, help="seconds of compute between saves (longer than one write)"
    )
    args = ap.parse_args()
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
    print(f"{'mode':<8}{'blocked per save (s)':>24}{'mean':>10}{'final wait (s)':>16}{'valid':>8}")
    for name, r in results.items():
        per = ", ".join(f"{x:.2f}" for x in r["blocked_s"])
        print(f"{name:<8}{per:>24}{r['mean_blocked_s']:>10.3f}{r['final_wait_s']:>16.2f}{str(r['valid']):>8}")
    print(f"async / sync blocked time: {ratio:.3f}x (goal <= 0.10x: {'met' if ratio <= 0.10 else 'missed'})")
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "checkpoint_save.json").write_text(json.dumps({"bytes": total, "ratio": ratio, **results}, indent=1))


if __name__ == "__main__":
    main()
