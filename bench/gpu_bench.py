"""The steps of ``bench/gpu.sh``: one device, a ~1B Llama trained by neuron_parallel's entry point
against a plain transformers + AdamW loop, MFU, and the planner's peak memory against the
measured one.

    python bench/gpu_bench.py check | missing | prepare WORK | ours WORK | plain WORK | report WORK

Settings come from the environment (``gpu.sh`` documents them): DEVICE, MODEL, SEQ, MBS, STEPS,
WARMUP, HARDWARE, RESULTS.

* ``prepare``: the model directory (``config.json`` of the chosen shape, the model built on the
  meta device, then allocated on DEVICE and random-initialised: normal(0, initializer_range) for
  matrices, ones for norms; saved in bf16), a dataset of random token rows in the format
  ``neuron_parallel.batches`` reads (``input_ids`` and their next-token ``labels``, saved with
  ``datasets.save_to_disk``, as the tokenize step saves it), and the training job (bf16 autocast
  with fp32 master weights, one rank, ``train.profile_memory``).
* ``ours``: ``neuron_parallel.launch.run_torchrun``, the launcher the pipeline uses, which runs
  ``torchrun --standalone --nproc_per_node 1 -m neuron_parallel.train job.json``.
* ``plain``: the baseline in this process, on the same device: ``AutoModelForCausalLM`` from the
  same directory in fp32, ``torch.autocast`` bf16, the same batches (``BlockStream``, same seed),
  ``torch.nn.utils.clip_grad_norm_`` and ``torch.optim.AdamW`` (torch's default implementation)
  with the job's settings; a step timed from batch fetch to ``loss.item()``, which waits for the
  device (``train.py`` times the steps between two synchronized log steps instead).
* ``report``: tokens/s (median of the steps after WARMUP), MFU = tokens/s × FLOPs per token /
  peak, where FLOPs per token is ``6 N_non_embedding + 12 L H Q T``
  (``ModelShape.flops_per_token``) and the peak is the hardware catalog's dense bf16 FLOP/s of
  HARDWARE (``neuron_parallel.planning.hardware``; h200: 989 TFLOP/s); and the planner's
  predicted peak (``neuron_parallel.planning.memory.job_rank_memory``) against the measured
  ``max_memory_allocated`` that the training rank reports in ``memory.json``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import sys
import time
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {
    # 1,104,218,112 parameters, 1,038,682,112 without the input embedding (the report counts them).
    "1b": dict(
        hidden_size=2048,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=8192,
        vocab_size=32000,
    ),
    # The CPU dry run's model: every step of the script, in seconds.
    "tiny": dict(
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=352,
        vocab_size=1024,
    ),
}
SEED, LR, BETAS, MAX_GRAD_NORM = 0, 1e-4, (0.9, 0.95), 1.0
# The project's dependencies this benchmark imports (module, distribution); torch is the machine's own.
NEEDED = (
    ("transformers", "transformers"),
    ("datasets", "datasets"),
    ("safetensors", "safetensors"),
    ("tokenizers", "tokenizers"),
    ("huggingface_hub", "huggingface-hub"),
    ("yaml", "pyyaml"),
)


def settings() -> dict:
    env = os.environ.get
    model = env("MODEL", "1b")
    if model not in SHAPES:
        raise SystemExit(f"MODEL={model!r} is not one of {sorted(SHAPES)}")
    s = dict(
        device=env("DEVICE", "cuda"),
        model=model,
        seq=int(env("SEQ", "2048")),
        mbs=int(env("MBS", "8")),
        steps=int(env("STEPS", "20")),
        warmup=int(env("WARMUP", "5")),
        hardware=env("HARDWARE", "h200"),
    )
    if s["steps"] < s["warmup"] + 2:
        raise SystemExit(f"STEPS={s['steps']} must exceed WARMUP={s['warmup']} by at least 2 (timed steps)")
    return s


def log(msg: str) -> None:
    print(f"[gpu-bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --------------------------------------------------------------------------------------------
# check, missing


def check() -> None:
    """Exit 2 with the fix when DEVICE is cuda and torch sees no CUDA device."""
    import torch

    s = settings()
    if s["device"] not in ("cuda", "cpu"):
        raise SystemExit(f"DEVICE={s['device']!r}: this benchmark runs on cuda, or on cpu as a dry run")
    if s["device"] == "cuda" and not torch.cuda.is_available():
        print(
            f"error: no CUDA device: torch {torch.__version__} (CUDA build: {torch.version.cuda or 'none'}) sees "
            "none. Run on a GPU machine, or set DEVICE=cpu MODEL=tiny for a dry run on CPU.",
            file=sys.stderr,
        )
        raise SystemExit(2)
    where = torch.cuda.get_device_name(0) if s["device"] == "cuda" else f"cpu ({os.cpu_count()} cores)"
    log(f"torch {torch.__version__} on {where}; settings {s}")
    found = [f"{dist} {metadata.version(dist)}" for module, dist in NEEDED if importlib.util.find_spec(module)]
    log("dependencies found: " + ", ".join(found))


def missing() -> None:
    """The pinned requirement (from pyproject.toml) of every needed dependency that is not
    importable, one per line."""
    import tomllib

    pins = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    by_name = {p.split("=")[0].split(">")[0].split("<")[0].strip().lower(): p for p in pins}
    for module, dist in NEEDED:
        if importlib.util.find_spec(module) is None:
            print(by_name.get(dist, dist))


# --------------------------------------------------------------------------------------------
# prepare


def device_of(s: dict):
    import torch

    return torch.device("cuda", 0) if s["device"] == "cuda" else torch.device("cpu")


def write_model(s: dict, model_dir: Path) -> dict:
    """Build the model on the meta device, allocate it on the device, initialise, save in bf16."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        **SHAPES[s["model"]], max_position_embeddings=s["seq"], tie_word_embeddings=False, rms_norm_eps=1e-5
    )
    transformers.utils.logging.disable_progress_bar()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.to_empty(device=device_of(s))
    g = torch.Generator(device=device_of(s)).manual_seed(SEED)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, config.initializer_range, generator=g)
            else:
                p.fill_(1.0)
    model.to(torch.bfloat16).save_pretrained(model_dir)
    total = sum(p.numel() for p in model.parameters())
    return {"params": total, "params_non_embedding": total - model.model.embed_tokens.weight.numel()}


def write_dataset(s: dict, path: Path) -> int:
    """Random token rows: ``input_ids`` and their next-token ``labels`` (a causal stream, no
    ``position_ids``), one row per sequence of every step; returns the row count."""
    import torch
    from datasets import Dataset

    rows = s["steps"] * s["mbs"]
    g = torch.Generator().manual_seed(SEED)
    tokens = torch.randint(0, SHAPES[s["model"]]["vocab_size"], (rows, s["seq"] + 1), generator=g, dtype=torch.int32)
    data = {"input_ids": tokens[:, :-1].tolist(), "labels": tokens[:, 1:].tolist()}
    Dataset.from_dict(data).save_to_disk(str(path))
    return rows


def write_job(s: dict, work: Path) -> Path:
    from neuron_parallel.config import DataConfig, JobConfig, LaunchConfig, ParallelConfig, TrainConfig

    job = JobConfig(
        model_path=str(work / "model"),
        dataset_path=str(work / "data"),
        output_dir=str(work / "run"),
        data=DataConfig(block_size=s["seq"]),
        parallel=ParallelConfig(mixed_precision="bf16"),
        train=TrainConfig(
            max_steps=s["steps"],
            save_every=0,  # the one checkpoint the entry point always writes: after the last step
            keep_checkpoints=1,
            seed=SEED,
            global_batch_size=s["mbs"],
            micro_batch_size=s["mbs"],
            lr=LR,
            lr_schedule="constant",
            betas=BETAS,
            max_grad_norm=MAX_GRAD_NORM,
            profile_memory=True,
            report_to=[],
        ),
        launch=LaunchConfig(device=s["device"], nproc_per_node=1),
    )
    path = work / "job.json"
    path.write_text(job.to_json())
    return path


def prepare(work: Path) -> None:
    s = settings()
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    counts = write_model(s, work / "model")
    rows = write_dataset(s, work / "data")
    write_job(s, work)
    (work / "facts.json").write_text(json.dumps({"settings": s, **counts, "rows": rows}))
    log(
        f"model {s['model']}: {counts['params']:,} parameters ({counts['params_non_embedding']:,} without the input "
        f"embedding), {rows} random rows of {s['seq']} tokens ({time.perf_counter() - t0:.0f} s)"
    )


# --------------------------------------------------------------------------------------------
# ours, plain


def ours(work: Path) -> None:
    from neuron_parallel.config import JobConfig
    from neuron_parallel.launch import run_torchrun

    job = JobConfig.load(work / "job.json")

    def show(event: dict) -> None:
        if event["event"] == "step":
            log(f"ours step {event['step']}: loss {event['loss']:.4f}, {event['tokens_per_s']:,.0f} tokens/s")
        elif event["event"] in ("memory", "checkpoint", "done"):
            log(f"ours {event['event']}: {json.dumps({k: v for k, v in event.items() if k != 'event'})}")

    t0 = time.perf_counter()
    run_torchrun(job, job.launch, on_event=show, on_line=lambda line: print(line, file=sys.stderr))
    log(f"ours: torchrun done in {time.perf_counter() - t0:.0f} s (start-up, steps and the final checkpoint)")


def plain(work: Path) -> None:
    """The baseline loop (see the module docstring); writes ``plain.json``."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    from neuron_parallel.batches import BlockStream

    s = settings()
    device = device_of(s)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    transformers.utils.logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(work / "model", dtype=torch.float32, attn_implementation="sdpa")
    model.to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=1e-8, weight_decay=0.0)
    stream = BlockStream(work / "data", seed=SEED)
    steps = []
    for step in range(1, s["steps"] + 1):
        t0 = time.perf_counter()
        torch.manual_seed(SEED * 100_003 + step)
        batch = stream.batch((step - 1) * s["mbs"], s["mbs"])
        inputs, labels = batch.inputs.to(device), batch.labels.to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            # labels are already next-token targets: the loss over all positions, unshifted
            loss = model(input_ids=inputs, labels=labels, shift_labels=labels, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
        opt.step()
        opt.zero_grad(set_to_none=True)
        value = loss.item()  # waits for the device: the step's time holds its device work
        dt = time.perf_counter() - t0
        steps.append({"step": step, "loss": value, "step_time_s": dt, "tokens_per_s": s["mbs"] * s["seq"] / dt})
        log(f"plain step {step}: loss {value:.4f}, {steps[-1]['tokens_per_s']:,.0f} tokens/s")
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    out = {"steps": steps, "max_memory_allocated": peak, "foreach": opt.defaults.get("foreach")}
    (work / "plain.json").write_text(json.dumps(out))


# --------------------------------------------------------------------------------------------
# report


def _median_tps(rows: list[dict], warmup: int) -> float:
    return statistics.median(r["tokens_per_s"] for r in rows if r["step"] > warmup)


def measure(work: Path) -> dict:
    """Every figure of the report, from the runs' files."""
    from neuron_parallel.planning.hardware import get_hardware
    from neuron_parallel.planning.model import ModelShape
    from neuron_parallel.reporting import read_metrics

    facts = json.loads((work / "facts.json").read_text())
    s = facts["settings"]
    shape = ModelShape.from_config(work / "model")
    flops = shape.flops_per_token(s["seq"])
    hw = get_hardware(s["hardware"]) if s["device"] == "cuda" else get_hardware("cpu", 1)
    ours_rows = read_metrics(work / "run" / "metrics.jsonl")
    plain_rows = json.loads((work / "plain.json").read_text())
    mem = json.loads((work / "run" / "memory.json").read_text())[0]
    ours_tps, plain_tps = _median_tps(ours_rows, s["warmup"]), _median_tps(plain_rows["steps"], s["warmup"])
    losses = zip((r["loss"] for r in ours_rows), (r["loss"] for r in plain_rows["steps"]))
    return {
        "settings": s,
        "params": facts["params"],
        "params_non_embedding": facts["params_non_embedding"],
        "flops_per_token": flops,
        "hardware": hw.name,
        "peak_flops": hw.peak_flops_per_rank,
        "ours_tokens_per_s": ours_tps,
        "plain_tokens_per_s": plain_tps,
        "ratio_ours_over_plain": ours_tps / plain_tps,
        "mfu_ours": ours_tps * flops / hw.peak_flops_per_rank,
        "mfu_plain": plain_tps * flops / hw.peak_flops_per_rank,
        "memory_predicted_bytes": mem["predicted_bytes"],
        "memory_measured_bytes": mem["measured_bytes"],
        "memory_measured_over_predicted": mem["measured_bytes"] / mem["predicted_bytes"],
        "memory_predicted_breakdown": mem["predicted"],
        "memory_measured_how": mem["phase"],
        "plain_max_memory_allocated": plain_rows["max_memory_allocated"],
        "max_loss_difference": max(abs(a - b) for a, b in losses),
        "timed_steps": s["steps"] - s["warmup"],
    }


def _bytes(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _flops(n: float) -> str:
    return f"{n / 1e12:.0f} TFLOP/s" if n >= 1e12 else f"{n / 1e9:.0f} GFLOP/s"


def report(work: Path) -> None:
    from neuron_parallel.planning.memory import COMPONENTS

    r = measure(work)
    s = r["settings"]
    nominal = " (nominal CPU figure: a dry run, not an MFU)" if s["device"] == "cpu" else ""
    lines = [
        f"model {s['model']}: {r['params']:,} parameters, {r['params_non_embedding']:,} without the input "
        f"embedding; seq {s['seq']}, micro batch {s['mbs']}, bf16 autocast, fp32 master weights, SDPA; "
        f"{r['timed_steps']} timed steps after {s['warmup']} warm-up",
        f"FLOPs per token 6*N_non_embedding + 12*L*H*Q*T (planning/model) = {r['flops_per_token'] / 1e9:.4g} "
        f"GFLOP; peak {_flops(r['peak_flops'])} ({r['hardware']}, planning/hardware){nominal}",
        f"tokens/s   ours {r['ours_tokens_per_s']:,.0f}   plain transformers+AdamW {r['plain_tokens_per_s']:,.0f}   "
        f"ratio {r['ratio_ours_over_plain']:.3f}x",
        f"MFU        ours {100 * r['mfu_ours']:.1f}%   plain {100 * r['mfu_plain']:.1f}%{nominal}",
        f"memory     planner predicted {_bytes(r['memory_predicted_bytes'])}, measured "
        f"{_bytes(r['memory_measured_bytes'])} ({r['memory_measured_how']}): measured/predicted "
        f"{r['memory_measured_over_predicted']:.3f}",
        "           predicted by component: "
        + ", ".join(f"{k} {_bytes(v)}" for k, v in r["memory_predicted_breakdown"].items() if k in COMPONENTS and v),
        f"loss       largest |ours - plain| over {s['steps']} steps: {r['max_loss_difference']:.2e} (same initial "
        "weights and batches)",
    ]
    if r["plain_max_memory_allocated"] is not None:
        lines.append(f"           (plain loop's max_memory_allocated: {_bytes(r['plain_max_memory_allocated'])})")
    print("\n".join(["", "=" * 100, *lines, "=" * 100]), flush=True)
    path = Path(os.environ.get("RESULTS", ROOT / "bench" / "results")) / f"gpu_{s['device']}_{s['model']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(r, indent=1))
    log(f"wrote {path}")


def main(argv: list[str]) -> None:
    steps = {"check": check, "missing": missing, "prepare": prepare, "ours": ours, "plain": plain, "report": report}
    if not argv or argv[0] not in steps or (argv[0] not in ("check", "missing") and len(argv) != 2):
        raise SystemExit(f"usage: {sys.argv[0]} check | missing | prepare WORK | ours WORK | plain WORK | report WORK")
    steps[argv[0]](*[Path(a) for a in argv[1:]])


if __name__ == "__main__":
    main(sys.argv[1:])
