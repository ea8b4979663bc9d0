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
import statistics
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


# --------------------------------------------------------------------------------------------
# report


def _median_tps(rows: list[dict], warmup: int) -> float:
    return statistics.median(r["tokens_per_s"] for r in rows if r["step"] > warmup)


def _read(path: Path):
    """A step's JSON output, None where the step did not write it."""
    return json.loads(path.read_text()) if path.is_file() else None


def measure(work: Path) -> dict:
    """Every figure of the report, from the steps' files; what a step did not leave is listed
    under ``missing``."""
    from neuron_parallel.planning.hardware import get_hardware
    from neuron_parallel.planning.model import ModelShape
    from neuron_parallel.reporting import read_metrics

    facts = json.loads((work / "facts.json").read_text())
    s = facts["settings"]
    shape = ModelShape.from_config(work / "model")
    flops = shape.flops_per_token(s["seq"])
    hw = get_hardware(s["hardware"]) if s["device"] == "cuda" else get_hardware("cpu", 1)
    r = {
        "settings": s,
        "params": facts["params"],
        "params_non_embedding": facts["params_non_embedding"],
        "flops_per_token": flops,
        "hardware": hw.name,
        "peak_flops": hw.peak_flops("bf16"),
        "timed_steps": s["steps"] - s["warmup"],
        "log_every": log_every(s),
        "missing": [],
    }
    metrics, plain_out = work / "run" / "metrics.jsonl", _read(work / "plain.json")
    ours_rows = read_metrics(metrics) if metrics.is_file() else []
    kernels_out, rank_out = _read(work / "kernels.json") or {}, _read(work / "rank.json") or {}
    matmul = kernels_out.get("matmul", {})
    measured_peak = matmul.get("flops_per_s")
    if measured_peak:
        r["matmul_flops_per_s"] = measured_peak
        r["matmul_over_datasheet"] = measured_peak / r["peak_flops"]
    r["matmul"] = matmul or None
    for name, rows in (("ours", ours_rows), ("plain", plain_out["steps"] if plain_out else [])):
        if len(rows) < s["steps"]:
            r["missing"].append(f"{name} run ({len(rows)} of {s['steps']} steps)")
            continue
        tps = _median_tps(rows, s["warmup"])
        r[f"{name}_tokens_per_s"] = tps
        r[f"mfu_{name}"] = tps * flops / r["peak_flops"]
        if measured_peak:
            r[f"mfu_{name}_vs_matmul"] = tps * flops / measured_peak
    if "ours_tokens_per_s" in r and "plain_tokens_per_s" in r:
        r["ratio_ours_over_plain"] = r["ours_tokens_per_s"] / r["plain_tokens_per_s"]
        losses = zip((x["loss"] for x in ours_rows), (x["loss"] for x in plain_out["steps"]))
        r["max_loss_difference"] = max(abs(a - b) for a, b in losses)
    mem = _read(work / "run" / "memory.json")
    if mem:
        mem = mem[0]
        r["memory_predicted_bytes"] = mem["predicted_bytes"]
        r["memory_measured_bytes"] = mem["measured_bytes"]
        r["memory_measured_over_predicted"] = mem["measured_bytes"] / mem["predicted_bytes"]
        r["memory_predicted_breakdown"] = mem["predicted"]
        r["memory_measured_how"] = mem["phase"]
    else:
        r["missing"].append("memory.json of the ours run")
    r["plain_max_memory_allocated"] = plain_out["max_memory_allocated"] if plain_out else None
    bf16 = rank_out.get("bf16", {})
    syncs = bf16.get("syncs_per_step")
    r["host_syncs_per_step"] = syncs
    if isinstance(syncs, list):
        r["host_syncs_per_plain_step"] = max(syncs[1:])  # the first step sets up lazily
        r["host_sync_sites"] = bf16.get("sync_sites")
    r["packed_attention"] = kernels_out.get("packed_attention")
    r["loss_parity_bf16_vs_fp32"] = rank_out.get("loss_parity")
    r["bf16_steps"], r["fp32_steps"] = bf16 or None, rank_out.get("fp32")
    for name, value in (("kernels", kernels_out), ("rank", rank_out)):
        if not value:
            r["missing"].append(f"{name}.json")
        r["missing"] += [f"{name}: {k}: {v['error']}" for k, v in value.items() if isinstance(v, dict) and "error" in v]
    return r


def _bytes(n) -> str:
    if not isinstance(n, int | float):
        return str(n)
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _flops(n: float) -> str:
    return f"{n / 1e12:.0f} TFLOP/s" if n >= 1e12 else f"{n / 1e9:.0f} GFLOP/s"


def _attention_lines(a: dict | None) -> list[str]:
    if not a or "paths" not in a:
        return ["attention  packed rows: " + (a or {}).get("error", "not measured")]
    lines = [
        f"attention  packed rows ({a['rows']} x {a['seq']}, {a['documents_per_row']} documents a row, "
        f"{a['heads']}/{a['kv_heads']} heads of {a['head_dim']}, bf16): ours against SDPA with the explicit mask"
    ]
    for name, p in a["paths"].items():
        fb = p["forward_backward_s"]
        fb = f"{1e3 * fb:.2f} ms" if isinstance(fb, float) else fb
        lines.append(
            f"           {name:<14} mask {p['mask']} {_bytes(p['mask_bytes'])}; forward {1e3 * p['forward_s']:.2f} ms "
            f"(peak {_bytes(p['forward_peak_bytes'])}); forward+backward {fb} "
            f"(peak {_bytes(p.get('forward_backward_peak_bytes', 'n/a'))})"
        )
    parity = ", ".join(
        f"{k} {v['max_abs']:.2e} ({v['max_rel']:.1e} rel)" for k, v in a["ours_vs_explicit_sdpa"].items()
    )
    lines.append(f"           ours - explicit, max |difference|: {parity}")
    if "flex_forward_vs_explicit_sdpa" in a:
        v = a["flex_forward_vs_explicit_sdpa"]["out"]
        lines.append(
            f"           FlexAttention forward (eager) - explicit: {v['max_abs']:.2e} ({v['max_rel']:.1e} rel)"
        )
    lines.append(
        f"           ours within twice the explicit mask's error against fp32: {a['ours_as_exact_as_explicit']}"
    )
    return lines


def report(work: Path) -> None:
    from neuron_parallel.planning.memory import COMPONENTS

    r = measure(work)
    s = r["settings"]
    nominal = " (nominal CPU figure: a dry run, not an MFU)" if s["device"] == "cpu" else ""
    lines = [
        f"model {s['model']}: {r['params']:,} parameters, {r['params_non_embedding']:,} without the input "
        f"embedding; seq {s['seq']}, micro batch {s['mbs']}, bf16 autocast, fp32 master weights, SDPA; "
        f"{r['timed_steps']} timed steps after {s['warmup']} warm-up, a synchronize every {r['log_every']} steps",
        f"FLOPs per token 6*N_non_embedding + 12*L*H*Q*T (planning/model) = {r['flops_per_token'] / 1e9:.4g} "
        f"GFLOP; peak {_flops(r['peak_flops'])} ({r['hardware']}, planning/hardware){nominal}",
    ]
    if "matmul_flops_per_s" in r:
        m = r["matmul"]
        lines.append(
            f"matmul     bf16 {m['n']}^3 measured here: {_flops(r['matmul_flops_per_s'])} "
            f"({100 * r['matmul_over_datasheet']:.0f}% of the catalog's peak; {m['how']})"
            + (" (the CPU peak is nominal)" if nominal else "")
        )
    if "ratio_ours_over_plain" in r:
        vs = lambda k: f" ({100 * r[k]:.1f}% of the measured matmul)" if k in r else ""  # noqa: E731
        lines += [
            f"tokens/s   ours {r['ours_tokens_per_s']:,.0f}   plain transformers+AdamW "
            f"{r['plain_tokens_per_s']:,.0f}   ratio {r['ratio_ours_over_plain']:.3f}x (both timed between "
            "synchronized steps)",
            f"MFU        ours {100 * r['mfu_ours']:.1f}%{vs('mfu_ours_vs_matmul')}   plain {100 * r['mfu_plain']:.1f}%"
            f"{vs('mfu_plain_vs_matmul')}{nominal}",
            f"loss       largest |ours - plain| over {s['steps']} steps: {r['max_loss_difference']:.2e} (same initial "
            "weights and batches)",
        ]
    if "memory_predicted_bytes" in r:
        lines += [
            f"memory     planner predicted {_bytes(r['memory_predicted_bytes'])}, measured "
            f"{_bytes(r['memory_measured_bytes'])} ({r['memory_measured_how']}): measured/predicted "
            f"{r['memory_measured_over_predicted']:.3f}",
            "           predicted by component: "
            + ", ".join(
                f"{k} {_bytes(v)}" for k, v in r["memory_predicted_breakdown"].items() if k in COMPONENTS and v
            ),
        ]
    if r["plain_max_memory_allocated"] is not None:
        lines.append(f"           (plain loop's max_memory_allocated: {_bytes(r['plain_max_memory_allocated'])})")
    syncs = r["host_syncs_per_step"]
    if isinstance(syncs, list):
        lines.append(
            f"host syncs per step of the trainer (cuda sync debug mode): {syncs} (steps 1-{len(syncs)}; "
            f"plain steps after the first: at most {r['host_syncs_per_plain_step']})"
        )
        lines += [f"           {n} x {site}" for site, n in sorted((r["host_sync_sites"] or {}).items())[:12]]
    else:
        lines.append(f"host syncs per step: {syncs or 'not measured'}" + (" (CPU)" if syncs else ""))
    lines += _attention_lines(r["packed_attention"])
    parity = r["loss_parity_bf16_vs_fp32"]
    if parity:
        lines.append(
            f"precision  bf16 against fp32 (TF32 off), {parity['steps']} steps of the trainer: relative loss "
            f"difference {', '.join(f'{x:.1e}' for x in parity['rel'])}; within {parity['rtol']:g}: {parity['ok']}"
        )
    lines += [f"MISSING    {m}" for m in r["missing"]]
    print("\n".join(["", "=" * 100, *lines, "=" * 100]), flush=True)
    path = Path(os.environ.get("RESULTS", ROOT / "bench" / "results")) / f"gpu_{s['device']}_{s['model']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(r, indent=1))
    log(f"wrote {path}")


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
