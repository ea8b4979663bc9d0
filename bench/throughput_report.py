"""The report of ``train_throughput.py``: cell formatting, the results table, the info rows that
cross-check a wall-clock ratio against other people's load (20th-percentile steps, scheduler
statistics) and the notes that say when load rather than the code moved a number."""

from __future__ import annotations

import math

# bench/ is on sys.path (the running script's folder)
from bench_util import median
from bench_util import print_table as print_cells

# --------------------------------------------------------------------------------------------
# report


def row(metric: str, ours_s: str, baseline_s: str, ratio_s: str, goal: str = "info", met: str = "-") -> dict:
    """One line of the results table."""
    return dict(metric=metric, ours_s=ours_s, baseline_s=baseline_s, ratio_s=ratio_s, goal=goal, met=met)


def fmt(x, kind: str) -> str:
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
    """The results table: one line per ``row``."""
    headers = ["metric", "ours", "baseline", "ratio", "goal", "met?"]
    print_cells(headers, [[r["metric"], r["ours_s"], r["baseline_s"], r["ratio_s"], r["goal"], r["met"]] for r in rows])


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
        row(
            "  info: same steps, 20th-percentile step time",
            fmt(o_t, "tps"),
            fmt(b_t, "tps"),
            fmt(o_t / b_t, "ratio"),
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
            row(
                label,
                f"{o_t:,.0f} {unit}",
                f"{b_t:,.0f} {unit}",
                fmt(o_t / b_t, "ratio"),
            )
        )


def pooled(runs: list[dict], key: str) -> float:
    """The median of one per-step series over all runs of a side."""
    return median([x for run in runs for x in run[key]])
