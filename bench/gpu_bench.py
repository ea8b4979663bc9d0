"""The steps of ``bench/gpu.sh``: one device, a ~1B Llama trained by neuron_parallel's entry point
against a plain transformers + AdamW loop; MFU, the planner's peak memory against the measured
one, host syncs per step, packed-row attention, and bf16 against fp32.

    python bench/gpu_bench.py check | missing | wheels DIR | imports
    python bench/gpu_bench.py prepare | ours | plain | kernels | rank | report  WORK

Settings come from the environment (``gpu.sh`` documents them): DEVICE, MODEL, SEQ, MBS, STEPS,
WARMUP, HARDWARE, RESULTS.

* ``missing``: the pinned requirement (``.ci/constraints.txt``) of every dependency this
  benchmark imports that this Python cannot find; ``wheels DIR``: the wheels in DIR whose
  distribution is not installed; ``imports``: imports each dependency, exit 2 naming the one
  that fails.
* ``prepare``: the model directory (``config.json`` of the chosen shape, the model built on the
  meta device, then allocated on DEVICE and random-initialised: normal(0, initializer_range) for
  matrices, ones for norms; saved in bf16), a dataset of random token rows in the format
  ``neuron_parallel.batches`` reads (``input_ids`` and their next-token ``labels``, saved with
  ``datasets.save_to_disk``, as the tokenize step saves it), and the training job (bf16 autocast
  with fp32 master weights, one rank, ``train.profile_memory``, ``train.log_every`` = the
  greatest common divisor of WARMUP and STEPS).
* ``ours``: ``neuron_parallel.launch.run_torchrun``, the launcher the pipeline uses, which runs
  ``torchrun --standalone --nproc_per_node 1 -m neuron_parallel.train job.json``. The trainer
  times its steps between two synchronized log steps (``neuron_parallel.step_log``).
* ``plain``: the baseline in this process, on the same device: ``AutoModelForCausalLM`` from the
  same directory in fp32, ``torch.autocast`` bf16, the same batches (``BlockStream``, same seed),
  ``torch.nn.utils.clip_grad_norm_`` and ``torch.optim.AdamW`` (torch's default implementation)
  with the job's settings, timed as the trainer times itself: ``StepRows`` synchronizes the
  device at the same log steps and shares the time between them over their steps; the losses
  are read after the time is taken.
* ``kernels``: the bf16 matmul rate of this device in this run, and packed-row attention, the
  trainer's path against SDPA with an explicit mask (``gpu_probes``).
* ``rank``: the trainer's own steps in this process (a world of one): the host syncs of each
  step under ``torch.cuda.set_sync_debug_mode("warn")`` (on CPU: not applicable), and the losses
  of :data:`PARITY_STEPS` steps in bf16 against the same steps in fp32 (TF32 off).
* ``report``: tokens/s (median of the steps after WARMUP), MFU = tokens/s × FLOPs per token /
  peak, where FLOPs per token is ``6 N_non_embedding + 12 L H Q T``
  (``ModelShape.flops_per_token``) and the peak is the hardware catalog's dense bf16 FLOP/s of
  HARDWARE (``neuron_parallel.planning.hardware``; h200: 989 TFLOP/s), and again against the
  matmul rate measured by ``kernels``; the planner's predicted peak
  (``neuron_parallel.planning.memory.job_rank_memory``) against the measured
  ``max_memory_allocated`` that the training rank reports in ``memory.json``; and what
  ``kernels`` and ``rank`` found. A step that did not finish is reported as missing.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import os
import re
import sys
import time
import traceback
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
CONSTRAINTS = ROOT / ".ci" / "constraints.txt"
"""The exact versions the project is tested with (``make test`` installs them)."""
PARITY_STEPS, PARITY_RTOL = 3, 1e-2
"""Steps of the bf16 against fp32 comparison, and the largest relative loss difference allowed."""
SYNC_STEPS = 4
"""Steps whose host syncs ``rank`` counts: the first (lazy set-up) and the plain steps after it."""
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
    if s["seq"] < 8:
        raise SystemExit(f"SEQ={s['seq']} is too short: the packed-attention rows hold 4 documents; use 8 or more")
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


def pins() -> dict[str, str]:
    """The requirement ``.ci/constraints.txt`` pins per distribution (normalised name)."""
    out = {}
    for line in CONSTRAINTS.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name = re.split(r"[<>=!~ ;\[]", line, maxsplit=1)[0]
            out[_normal(name)] = line
    return out


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def missing() -> None:
    """The pinned requirement of every needed dependency that is not importable, one per line."""
    pinned = pins()
    for module, dist in NEEDED:
        if importlib.util.find_spec(module) is None:
            print(pinned.get(_normal(dist), dist))


def wheels(folder: Path) -> None:
    """The wheels in ``folder`` whose distribution is not installed, one path per line."""
    for wheel in sorted(folder.glob("*.whl")):
        dist = wheel.name.split("-")[0]
        try:
            metadata.version(dist)
        except metadata.PackageNotFoundError:
            print(wheel)


def imports() -> None:
    """Import every needed dependency; exit 2 naming the first that fails and why."""
    for module, dist in NEEDED:
        try:
            importlib.import_module(module)
        except Exception as e:  # an ImportError, or what a broken install raises while importing
            print(f"error: {dist} does not import: {type(e).__name__}: {str(e).splitlines()[0]}", file=sys.stderr)
            raise SystemExit(2) from None
    found = [f"{dist} {metadata.version(dist)}" for _, dist in NEEDED]
    log("dependencies import: " + ", ".join(found))


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


def log_every(s: dict) -> int:
    """The steps between two synchronized points, of both runs: the greatest common divisor of
    WARMUP and STEPS, so that the warm-up steps and the timed ones fall in different windows."""
    return math.gcd(s["warmup"], s["steps"])


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
            log_every=log_every(s),
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
    from neuron_parallel.step_log import PendingStep, StepRows

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
    tokens = s["mbs"] * s["seq"]
    window = StepRows(device, tokens)  # synchronizes: the first window holds the steps alone
    steps = []
    for step in range(1, s["steps"] + 1):
        torch.manual_seed(SEED * 100_003 + step)
        batch = stream.batch((step - 1) * s["mbs"], s["mbs"])
        inputs, labels = batch.inputs.to(device), batch.labels.to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            # labels are already next-token targets: the loss over all positions, unshifted
            loss = model(input_ids=inputs, labels=labels, shift_labels=labels, use_cache=False).loss
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
        opt.step()
        opt.zero_grad(set_to_none=True)
        n = batch.num_targets  # counted on the host; the loss is their mean
        window.add(PendingStep(step, LR, step * tokens, n, loss.detach() * n, norm.detach()))
        if step % log_every(s) == 0 or step == s["steps"]:
            rows = window.close()  # synchronizes, takes the time, then reads the losses
            for row in rows:
                log(f"plain step {row['step']}: loss {row['loss']:.4f}, {row['tokens_per_s']:,.0f} tokens/s")
            steps += rows
            window.restart()
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    out = {"steps": steps, "max_memory_allocated": peak, "foreach": opt.defaults.get("foreach")}
    (work / "plain.json").write_text(json.dumps(out))


# --------------------------------------------------------------------------------------------
# kernels, rank


def kernels(work: Path) -> None:
    """The matmul rate and the packed-row attention comparison (``gpu_probes``); writes
    ``kernels.json``, each part's error in place of its figures if it fails."""
    import gpu_probes
    import torch
    from transformers import AutoConfig

    s = settings()
    device = device_of(s)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    config = AutoConfig.from_pretrained(work / "model")
    parts = {
        "matmul": lambda: gpu_probes.matmul_flops(device),
        "packed_attention": lambda: gpu_probes.packed_attention(config, device, s["mbs"], s["seq"]),
    }
    out = {name: _attempt(name, fn) for name, fn in parts.items()}
    (work / "kernels.json").write_text(json.dumps(out, indent=1))


def rank(work: Path) -> None:
    """The trainer's own steps in this process: host syncs per step, and bf16 against fp32
    (``gpu_probes.train_steps``); writes ``rank.json``."""
    import dataclasses

    import gpu_probes
    import torch

    from neuron_parallel.config import JobConfig
    from neuron_parallel.mesh import close_distributed

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    job = JobConfig.load(work / "job.json")

    def run(name: str, precision: str, steps: int, **kwargs) -> dict:
        parallel = dataclasses.replace(job.parallel, mixed_precision=precision)
        one = dataclasses.replace(job, parallel=parallel, output_dir=str(work / f"rank-{name}"))
        return gpu_probes.train_steps(one, steps, **kwargs)

    out = {"bf16": _attempt("bf16 steps", lambda: run("bf16", "bf16", max(SYNC_STEPS, PARITY_STEPS), count_syncs=True))}
    out["fp32"] = _attempt("fp32 steps", lambda: run("fp32", "fp32", PARITY_STEPS, count_syncs=False, tf32=False))
    if "loss" in out["bf16"] and "loss" in out["fp32"]:
        bf16 = out["bf16"]["loss"][:PARITY_STEPS]
        out["loss_parity"] = gpu_probes.loss_parity(bf16, out["fp32"]["loss"], PARITY_RTOL)
    close_distributed()
    (work / "rank.json").write_text(json.dumps(out, indent=1))


def _attempt(name: str, fn) -> dict:
    """``fn()``'s result, or ``{"error": ...}`` with the traceback on stderr: one part that fails
    leaves the others' figures."""
    t0 = time.perf_counter()
    try:
        result = fn()
    except Exception as e:
        traceback.print_exc()
        log(f"{name}: failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
        return {"error": f"{type(e).__name__}: {e}"[:2000]}
    log(f"{name}: done in {time.perf_counter() - t0:.1f} s")
    return result


def report(work: Path) -> None:
    """The ``report`` step (``bench/gpu_report.py``)."""
    from gpu_report import report as write_report

    write_report(work)


def main(argv: list[str]) -> None:
    no_arg = {"check": check, "missing": missing, "imports": imports}
    with_dir = {
        "wheels": wheels,
        "prepare": prepare,
        "ours": ours,
        "plain": plain,
        "kernels": kernels,
        "rank": rank,
        "report": report,
    }
    if argv and argv[0] in no_arg and len(argv) == 1:
        return no_arg[argv[0]]()
    if argv and argv[0] in with_dir and len(argv) == 2:
        return with_dir[argv[0]](Path(argv[1]))
    raise SystemExit(
        f"usage: {sys.argv[0]} check | missing | imports | wheels DIR | prepare | ours | plain | kernels | rank | "
        "report WORK"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
