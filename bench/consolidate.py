"""Benchmark: streaming consolidation of one of our checkpoints vs ``cp``, DCP and an all-in-RAM merge.

    .venv/bin/python bench/consolidate.py [--quick] [--size-gb 2] [--workdir DIR] [--dtype float32|bfloat16]
                                          [--keep] [--profile]

1. Builds (untimed) a synthetic Llama-shaped checkpoint in our format at tp=4 x pp=2, and the same
   tensors as a DCP checkpoint (``synthetic_checkpoint.py``).
2. Measures, each in its own subprocess with the page cache dropped before it (``sync; echo 3 >
   /proc/sys/vm/drop_caches``; if that is refused, each run follows a warm-up read instead):
     a. ``cp -r`` of the shard files (and, separately, the ``sync`` that makes them durable);
     b. ``export_checkpoint(ckpt, out)`` (ours: one pass over each piece file that hashes it
        and copies its pieces into place; it fsyncs its output);
     c. DCP's ``format_utils.dcp_to_torch_save`` on the DCP checkpoint;
     d. an all-in-RAM merge as optimum-neuron's consolidation does it: ``load_file`` every tp
        shard of a stage, ``torch.cat`` the pieces, keep the merged state, ``save_file`` it.
   Peak RSS per run is the child's own ``getrusage(RUSAGE_SELF).ru_maxrss`` (RUSAGE_CHILDREN in
   the parent is a running maximum over all children, so it cannot separate runs), cross-checked
   by polling ``/proc/<pid>/status`` (VmHWM, and the RssAnon / RssFile split) every few ms.
3. Verifies every output (tensor names, total bytes, spot-checked tensors equal the pieces) and
   prints a table against the goals, with the CPU seconds of ours and of ``cp`` (time on a shared
   machine stretches with other people's load; CPU seconds much less); writes
   bench/results/consolidate.json.

``--quick``: a 0.3 GB bfloat16 checkpoint (the smallest the shape allows: 2 layers) instead of
2 GB of float32.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench_util import RESULTS, ROOT, parser, pick, print_table, proc_status, verdict, work_dir, write_results
from consolidate_methods import MiB, child_main
from synthetic_checkpoint import PP, TP

# --------------------------------------------------------------------------------------------
# The parent: build, measure, report


class _Poller(threading.Thread):
    def __init__(self, pid: int, every: float = 0.005) -> None:
        super().__init__(daemon=True)
        self.pid, self.every = pid, every
        self.peak: dict[str, int] = {}
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            st = proc_status(self.pid)
            if not st:
                break
            for k, v in st.items():
                self.peak[k] = max(self.peak.get(k, 0), v)
            time.sleep(self.every)


def drop_caches() -> bool:
    subprocess.run(["sync"], check=False)
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def warm(paths: list[Path]) -> None:
    for p in paths:
        for f in [p] if p.is_file() else sorted(x for x in p.rglob("*") if x.is_file()):
            with open(f, "rb") as fh:
                while fh.read(1 << 24):
                    pass


class Runner:
    def __init__(self, workdir: Path, cold: bool) -> None:
        self.workdir, self.cold = workdir, cold

    def prepare(self, inputs: list[Path]) -> str:
        subprocess.run(["sync"], check=False)
        if self.cold and drop_caches():
            return "cold"
        self.cold = False
        warm(inputs)
        return "warm"

    def child(self, kind: str, spec: dict, *, inputs: list[Path] | None = None, timeout: float = 900) -> dict:
        result = self.workdir / f"result-{kind}-{time.monotonic_ns()}.json"
        spec = {**spec, "result": str(result)}
        cache = self.prepare(inputs) if inputs is not None else "n/a"
        load = os.getloadavg()[0]
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONPATH": str(ROOT)}
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, __file__, "--child", kind, json.dumps(spec)], env=env)
        poller = _Poller(proc.pid)
        poller.start()
        try:
            rc = proc.wait(timeout=timeout)
        finally:
            poller.done.set()
            poller.join()
        wall = time.perf_counter() - t0
        if rc != 0:
            raise RuntimeError(f"child {kind} failed with exit status {rc}")
        res = json.loads(result.read_text())
        result.unlink()
        res.update(
            process_wall_s=wall,
            cache=cache,
            loadavg_1min_before=load,
            peak_rss_mib=res["ru_maxrss_kib"] / 1024,
            polled_vmhwm_mib=poller.peak.get("VmHWM", 0) / 1024,
            polled_max_rss_anon_mib=poller.peak.get("RssAnon", 0) / 1024,
            polled_max_rss_file_mib=poller.peak.get("RssFile", 0) / 1024,
        )
        return res

    def cp(self, src: Path, dst: Path) -> dict:
        cache = self.prepare([src])
        load = os.getloadavg()[0]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        subprocess.run(["cp", "-r", str(src), str(dst)], check=True)
        t_cp = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        subprocess.run(["sync"], check=True)
        t_sync = time.perf_counter() - t0
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        return {"seconds": t_cp, "seconds_with_sync": t_sync, "cpu_s": cpu, "cache": cache, "loadavg_1min_before": load}


def du(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def parse_args() -> argparse.Namespace:
    ap = parser(__doc__, "a 0.3 GB bfloat16 checkpoint")
    ap.add_argument("--size-gb", type=float, help="checkpoint size in GB (1e9 bytes); default 2")
    ap.add_argument("--workdir", type=Path, default=None, help="where the synthetic data goes (default: a temp dir)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], help="default float32")
    ap.add_argument("--keep", action="store_true", help="keep the synthetic checkpoints and outputs")
    ap.add_argument(
        "--warm", action="store_true", help="do not drop the page cache; warm-read the inputs before each run"
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="add a profiled run of ours (per-phase times, per-call wall and CPU time over its threads, RSS at the "
        "writes); not in the table",
    )
    ap.add_argument("--skip-dcp", action="store_true")
    ap.add_argument("--skip-allram", action="store_true")
    ap.add_argument("--results", type=Path, default=RESULTS / "consolidate.json")
    args = ap.parse_args()
    args.size_gb = pick(args.size_gb, args.quick, 0.3, 2.0)
    args.dtype = pick(args.dtype, args.quick, "bfloat16", "float32")
    return args


def build(runner: Runner, work: Path, args: argparse.Namespace, report: dict) -> tuple[dict, Path, Path]:
    """The synthetic checkpoint in our format (and the same tensors as DCP), untimed for the goals."""
    t0 = time.perf_counter()
    facts = runner.child("build", {"run": str(work / "run"), "size_bytes": args.size_gb * 1e9, "dtype": args.dtype})
    ckpt = Path(facts["checkpoint"])
    for k in ("result", "ru_maxrss_kib"):
        facts.pop(k, None)
    facts = {k: v for k, v in facts.items() if not k.startswith(("process_wall", "cache", "peak_rss", "polled"))}
    facts["build_s"] = time.perf_counter() - t0
    report["checkpoint"] = facts
    print(
        f"[bench] built {facts['num_shard_files']} shard files, {facts['shard_file_bytes'] / 1e9:.3f} GB, "
        f"{facts['layers']} layers {args.dtype}, largest tensor {facts['largest_tensor']} "
        f"{facts['largest_tensor_bytes'] / MiB:.1f} MiB ({facts['build_s']:.0f}s)",
        flush=True,
    )
    dcp_dir = work / "dcp"
    if not args.skip_dcp:
        t0 = time.perf_counter()
        runner.child("build_dcp", {"ckpt": str(ckpt), "dcp": str(dcp_dir)})
        report["dcp_checkpoint"] = {"bytes": du(dcp_dir), "build_s": time.perf_counter() - t0}
        print(f"[bench] built DCP checkpoint, {report['dcp_checkpoint']['bytes'] / 1e9:.3f} GB", flush=True)
    return facts, ckpt, dcp_dir


def measure(
    runner: Runner, ckpt: Path, runs: dict, kind: str, label: str, source: dict, inputs: list[Path], written: str
) -> None:
    """One conversion in its own child: peak memory and time, then its output verified."""
    out = runner.workdir / f"out_{kind}"
    runs[kind] = runner.child(kind, {**source, "out": str(out)}, inputs=inputs)
    runs[kind]["verify"] = _verify(runner, ckpt, out / written)
    runs[kind]["bytes"] = du(out / written)
    shutil.rmtree(out)
    _say(label, runs[kind])


def profile_ours(runner: Runner, ckpt: Path, shards: Path, runs: dict) -> None:
    """A profiled run of ours (per-phase wall times, per-call times summed over the copying
    threads, RSS at the writes); not in the table."""
    out = runner.workdir / "out_ours"
    runs["ours_profiled"] = runner.child("ours", {"ckpt": str(ckpt), "out": str(out), "profile": True}, inputs=[shards])
    shutil.rmtree(out)
    print(runs["ours_profiled"]["cprofile_tottime_top"])
    ph = runs["ours_profiled"]["phases"]
    print(
        "[bench] profiled phases, wall (s): "
        + ", ".join(f"{k[:-2]} {ph[k]:.2f}" for k in ("validate_s", "pass_wall_s", "fsync_s", "other_s"))
    )
    print(
        "[bench] inside the pass, summed over its threads, wall / on-CPU (s): "
        + ", ".join(f"{k[:-2]} {v:.2f}/{ph['threads_cpu'][k]:.2f}" for k, v in ph["threads"].items() if k != "fsync_s")
        + f"; process CPU {ph['process_cpu_s']:.2f}"
    )
    rss = ph["max_rss_at_writes"]
    print(
        f"[bench] largest RSS seen at a write: anon {rss['rss_anon_mib']:.0f} MiB, file {rss['rss_file_mib']:.0f} MiB"
    )
    _say("ours (profiled, not in table)", runs["ours_profiled"])


def measure_all(runner: Runner, args: argparse.Namespace, ckpt: Path, dcp_dir: Path) -> dict[str, dict]:
    """The idle floor, cp (+ sync), ours, the optional profiled ours, DCP and the all-in-RAM merge."""
    work = runner.workdir
    shards = ckpt / "shards"
    runs: dict[str, dict] = {}
    runs["idle"] = runner.child("idle", {})
    print(f"[bench] idle python+imports: {runs['idle']['peak_rss_mib']:.0f} MiB", flush=True)

    dst = work / "cp_out"
    runs["cp"] = runner.cp(shards, dst)
    runs["cp"]["bytes"] = du(dst)
    shutil.rmtree(dst)
    print(
        f"[bench] cp -r: {runs['cp']['seconds']:.2f}s "
        f"(+sync {runs['cp']['seconds_with_sync']:.2f}s), {runs['cp']['cpu_s']:.2f} CPU-s [{runs['cp']['cache']}]",
        flush=True,
    )

    measure(runner, ckpt, runs, "ours", "ours", {"ckpt": str(ckpt)}, [shards], "model.safetensors")
    if args.profile:
        profile_ours(runner, ckpt, shards, runs)
    if not args.skip_dcp:
        measure(runner, ckpt, runs, "dcp", "dcp_to_torch_save", {"dcp": str(dcp_dir)}, [dcp_dir], "model.pt")
    if not args.skip_allram:
        measure(runner, ckpt, runs, "allram", "all-in-RAM merge", {"ckpt": str(ckpt)}, [shards], "model.safetensors")
    return runs


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child_main(sys.argv[2:])
        return
    args = parse_args()
    work = work_dir(args.workdir, "consolidate-bench-")
    runner = Runner(work, cold=not args.warm)
    started = time.perf_counter()
    report: dict = {
        "host": {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform()}
    }
    try:
        print(f"[bench] workdir {work}", flush=True)
        facts, ckpt, dcp_dir = build(runner, work, args, report)
        runs = measure_all(runner, args, ckpt, dcp_dir)
        report["runs"] = runs
        report["goals"] = goals(facts, runs)
        report["total_s"] = time.perf_counter() - started
        print_report(facts, runs, report["goals"])
        print(f"\n[bench] {report['total_s']:.0f}s in all")
        write_results(args.results, report)
    finally:
        if args.keep:
            print(f"[bench] kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


def _verify(runner: Runner, ckpt: Path, path: Path) -> dict:
    res = runner.child("verify", {"ckpt": str(ckpt), "path": str(path)})
    keep = ("ok", "problems", "file_bytes", "payload_bytes", "expected_payload_bytes", "spot_checked")
    res = {k: res[k] for k in keep}
    if not res["ok"]:
        print(f"[bench] VERIFY FAILED for {path}: {res['problems']}", flush=True)
    return res


def _say(label: str, r: dict) -> None:
    print(
        f"[bench] {label}: {r['seconds']:.2f}s in-process ({r['process_wall_s']:.2f}s with start-up"
        + (f", {r['cpu_s']:.2f} CPU-s" if "cpu_s" in r else "")
        + "), "
        f"peak RSS {r['peak_rss_mib']:.0f} MiB (anon max {r['polled_max_rss_anon_mib']:.0f}, "
        f"file-backed max {r['polled_max_rss_file_mib']:.0f}) [{r['cache']}]"
        + (f", verify {'ok' if r['verify']['ok'] else 'FAILED'}" if "verify" in r else ""),
        flush=True,
    )


def goals(facts: dict, runs: dict) -> dict:
    nbytes = facts["shard_file_bytes"]
    ours = runs["ours"]
    g: dict = {}
    tp_ours = nbytes / ours["seconds"]
    tp_cp = nbytes / runs["cp"]["seconds"]
    tp_cp_sync = nbytes / runs["cp"]["seconds_with_sync"]
    g["throughput_vs_cp"] = {
        "ours_MBps": tp_ours / 1e6,
        "cp_MBps": tp_cp / 1e6,
        "ratio": tp_ours / tp_cp,
        "goal": 0.8,
        "met": tp_ours / tp_cp >= 0.8,
    }
    g["throughput_vs_cp_plus_sync"] = {
        "cp_sync_MBps": tp_cp_sync / 1e6,
        "ratio": tp_ours / tp_cp_sync,
        "goal": 0.8,
        "met": tp_ours / tp_cp_sync >= 0.8,
    }
    budget = 2 * facts["largest_tensor_bytes"] / MiB + 300
    g["rss_vs_budget"] = {"ours_mib": ours["peak_rss_mib"], "budget_mib": budget, "met": ours["peak_rss_mib"] <= budget}
    for other in ("dcp", "allram"):
        if other in runs:
            ratio = runs[other]["peak_rss_mib"] / ours["peak_rss_mib"]
            g[f"rss_vs_{other}"] = {
                "other_mib": runs[other]["peak_rss_mib"],
                "ours_mib": ours["peak_rss_mib"],
                "ratio": ratio,
                "goal": 5.0,
                "met": ratio >= 5.0,
            }
    stream_s = ours["seconds"] - ours.get("validate_s", 0.0)
    g["info_streaming_only"] = {
        "validate_s": ours.get("validate_s", 0.0),
        "streaming_s": stream_s,
        "ratio_vs_cp": (nbytes / stream_s) / tp_cp,
        "ratio_vs_cp_sync": (nbytes / stream_s) / tp_cp_sync,
    }
    g["outputs_verified"] = all(r["verify"]["ok"] for r in runs.values() if "verify" in r)
    return g


def _rows(runs: dict, nbytes: int) -> list[list[str]]:
    """The table's rows: cp, cp + sync, then each conversion with its memory and verification."""
    cp = runs["cp"]
    rows = [
        ["cp -r", f"{cp['seconds']:.2f}", f"{nbytes / cp['seconds'] / 1e6:.0f}", "-", "-", "-"]
        + [f"{cp['bytes'] / 1e9:.3f}", "-"],
        ["cp -r + sync", f"{cp['seconds_with_sync']:.2f}", f"{nbytes / cp['seconds_with_sync'] / 1e6:.0f}"]
        + ["-", "-", "-", "", "-"],
    ]
    for key, label in (("ours", "ours (streaming)"), ("dcp", "dcp_to_torch_save"), ("allram", "all-in-RAM merge")):
        if key in runs:
            r = runs[key]
            rows.append(
                [label, f"{r['seconds']:.2f}", f"{nbytes / r['seconds'] / 1e6:.0f}", f"{r['peak_rss_mib']:.0f}"]
                + [f"{r['polled_max_rss_anon_mib']:.0f}", f"{r['polled_max_rss_file_mib']:.0f}"]
                + [f"{r['bytes'] / 1e9:.3f}", "yes" if r["verify"]["ok"] else "NO"]
            )
    return rows


def _print_goals(runs: dict, g: dict) -> None:
    t = g["throughput_vs_cp"]
    print(f"throughput ours/cp = {t['ratio']:.2f}x (goal >= 0.8x: {verdict(t['met'])})")
    t = g["throughput_vs_cp_plus_sync"]
    print(
        f"throughput ours/(cp + sync) = {t['ratio']:.2f}x "
        f"(goal >= 0.8x; ours fsyncs, plain cp does not: {verdict(t['met'])})"
    )
    r = g["rss_vs_budget"]
    print(
        f"ours peak RSS {r['ours_mib']:.0f} MiB vs 2 x largest + 300 = {r['budget_mib']:.0f} MiB: {verdict(r['met'])}"
    )
    for other, label in (("dcp", "dcp_to_torch_save"), ("allram", "all-in-RAM")):
        if f"rss_vs_{other}" in g:
            r = g[f"rss_vs_{other}"]
            print(
                f"{label} RSS / ours = {r['other_mib']:.0f} / {r['ours_mib']:.0f} = "
                f"{r['ratio']:.1f}x (goal >= 5x: {verdict(r['met'])})"
            )
    i = g["info_streaming_only"]
    print(
        f"(info) ours = {i['validate_s']:.2f}s up-front checks + {i['streaming_s']:.2f}s copying; copying alone "
        f"is {i['ratio_vs_cp']:.2f}x cp, {i['ratio_vs_cp_sync']:.2f}x cp + sync"
    )
    if "cpu_s" in runs["ours"]:
        print(
            f"(info) CPU seconds (user + system), less inflated by other load than wall time: ours "
            f"{runs['ours']['cpu_s']:.2f} (sha256 of every byte read included), cp -r {runs['cp']['cpu_s']:.2f}"
        )
    print(
        "every output verified (names, byte total, spot-checked tensors equal the pieces): "
        + verdict(g["outputs_verified"])
    )


def print_report(facts: dict, runs: dict, g: dict) -> None:
    nbytes = facts["shard_file_bytes"]
    print()
    print(
        f"checkpoint: tp{TP} x pp{PP}, {facts['layers']} layers, {facts['dtype']}, {facts['num_tensors']} tensors in "
        f"{facts['num_shard_files']} files, {nbytes / 1e9:.3f} GB; largest tensor {facts['largest_tensor']} = "
        f"{facts['largest_tensor_bytes'] / MiB:.1f} MiB; page cache: {runs['ours']['cache']}"
    )
    print(
        f"idle python + imports RSS: {runs['idle']['peak_rss_mib']:.0f} MiB; 1-min load average before the runs: "
        + ", ".join(f"{k} {runs[k]['loadavg_1min_before']:.1f}" for k in ("cp", "ours", "dcp", "allram") if k in runs)
        + f" on {os.cpu_count()} CPUs"
    )
    print()
    headers = ["run", "time s", "MB/s", "peak RSS MiB", "anon max", "file max", "out GB", "verified"]
    print_table(headers, _rows(runs, nbytes))
    print()
    _print_goals(runs, g)


if __name__ == "__main__":
    main()
