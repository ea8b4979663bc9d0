"""The ``report`` step of ``bench/gpu.sh`` (``bench/gpu_bench.py report WORK``): every figure from
the files the other steps left in WORK, printed and written as JSON (see ``gpu_bench``'s docstring
for what each figure is)."""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

from gpu_bench import ROOT, log, log_every


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
