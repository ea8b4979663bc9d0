"""Benchmark: what ``neuron-flows run`` costs beyond its training steps.

    .venv/bin/python bench/flow_overhead.py [--quick] [--config configs/tiny-llama-cpu.yaml] [--steps 5]
                                            [--repeats 1] [--server temporary|running|both]
                                            [--command CMD [--command CMD2 ...]] [--imports]
                                            [--show] [--keep] [--json PATH]

Each run is the installed command ``neuron-flows run CONFIG --set train.max_steps=STEPS --set
output.dir=<fresh directory>`` as a subprocess, stdout and stderr merged, every line timestamped
as it arrives. ``--server temporary`` (the default) removes PREFECT_API_URL, so the command starts
Prefect's temporary server itself, as on a laptop; ``--server running`` first starts one
``prefect server start`` (its own PREFECT_HOME in a temporary folder, untimed) and points every
run at it; ``both`` measures the two, alternating. ``--command`` given more than once compares
commands (e.g. an older copy of the CLI: ``--command 'python old_cli.py'``), alternating within
each repeat so that both meet the same load.

Figures per run: the whole wall time (start to exit), the steps' own time (the sum of
``step_time_s`` over the run's ``metrics.jsonl``), the overhead (wall - steps), the CPU seconds
of the command's whole process tree (``getrusage`` of the reaped children), and a breakdown of the
wall time between milestones read from the output and the run directory:

  imports, config, preflight   start -> "Starting temporary server" (or the first line printed)
  temporary server start       "Starting temporary server" -> "Beginning flow run"
  flow start                   (with a running server: first line -> "Beginning flow run")
  preflight / tokenize / plan  each task's "Finished" line after the previous one
  train task set-up            plan finished -> job.json written (torchrun starts right after)
  torchrun + ranks to first step  job.json -> the ranks' "start" event (torchrun, rank imports,
                               model build, process group, data)
  steps                        "start" event -> the last "step N/N" line
  last step to checkpoint      last step -> the "checkpoint:" event of the final step
  ranks' exit                  checkpoint -> the train task's "Finished" line
  validate, consolidate, upload, report, flow end: each task's "Finished" line
  stop server, print           flow "Finished" -> the command's last line
  exit after last line         last line -> the process has exited

The sum of the breakdown is the wall time. For each phase the table adds the CPU seconds each kind
of process spent in it (the command, the temporary server, torchrun, the ranks; sampled from /proc
every 0.1 s) and the seconds their threads waited, runnable, for a core: on a shared machine wall
time swings with other people's load, CPU time hardly does, and the wait says how much load there
was. After each run the server's database is read (SQLite): the flow run's and task runs' states
and the number of logs and artifacts recorded, to show that nothing the run sent was lost. Lines
printed after the summary and any "Error logging to API" are reported.

``--imports`` adds ``python -X importtime`` of the modules the command loads (each in a fresh
interpreter): total, and the heaviest imports at the top two levels. Prints the table and the load
average before and after; ``--json`` writes every run (its lines with their times included).
``--quick``: 2 steps instead of 5.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import resource
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

# Imported before any run starts, so that their imports do not load the machine during one.
from bench_util import ROOT, cpu_seconds, loadavg, median, parser, pick, print_table, thread_waits_ns

from neuron_parallel.procs import cmdline, process_tree

BIN = Path(sys.executable).parent

TASKS = ("preflight", "tokenize", "plan", "train", "validate", "consolidate", "upload", "report")
PHASES = (
    "imports, config, preflight",
    "temporary server start",
    "flow start",
    "preflight task",
    "tokenize",
    "plan",
    "train task set-up",
    "torchrun + ranks to first step",
    "steps",
    "last step to checkpoint written",
    "ranks' exit",
    "validate",
    "consolidate",
    "upload",
    "report",
    "flow end",
    "stop server, print",
    "exit after last line",
)
IMPORT_TARGETS = (
    "neuron_flows.flows.cli",
    "neuron_flows.tasks.config",
    "neuron_flows.flows.finetune",
    "prefect.server.api.server",
    "neuron_parallel.train",
)

_TASK_DONE = re.compile(r"Task run '([a-z_]+)-\w+' - Finished in state (\w+)")
_STEP = re.compile(r"Task run 'train-\w+' - step (\d+)/(\d+)")


CATEGORIES = (("uvicorn", "server"), ("torch.distributed.run", "torchrun"), ("neuron_parallel.train", "ranks"))
"""Command-line markers of the run's processes; anything else in the tree is the command itself."""


def _category(pid: int) -> str | None:
    """The kind of process ``pid`` is, or None when its command line cannot be read (it has
    exited: a zombie's is empty)."""
    cmd = cmdline(pid)
    if not cmd:
        return None
    return next((name for marker, name in CATEGORIES if marker in cmd), "command")


class TreeSampler:
    """Samples, every ``every_s``, the CPU time of every process in the command's tree, by kind
    (``CATEGORIES``, read afresh each time: a rank starts with torchrun's command line until it
    executes its own), and the time their threads waited, runnable, for a core that other load
    held. A process's last ``every_s`` before it exits is not seen."""

    def __init__(self, root_pid: int, t0: float, every_s: float = 0.1):
        self.samples: list[tuple[float, dict[str, float], float]] = []  # (t, CPU s by kind, wait s)
        self._cpu: dict[int, tuple[str, float]] = {}
        self._waits: dict[tuple[int, str], float] = {}
        self._stop = threading.Event()

        def loop() -> None:
            while not self._stop.is_set():
                for pid in process_tree(root_pid):
                    try:
                        kind = _category(pid) or self._cpu.get(pid, ("command", 0.0))[0]
                        self._cpu[pid] = (kind, cpu_seconds(pid))
                        self._waits.update({(pid, tid): ns / 1e9 for tid, ns in thread_waits_ns(pid).items()})
                    except (OSError, ValueError, IndexError):
                        pass
                cpu: dict[str, float] = {}
                for kind, seconds in self._cpu.values():
                    cpu[kind] = cpu.get(kind, 0.0) + seconds
                self.samples.append((time.monotonic() - t0, cpu, sum(self._waits.values())))
                self._stop.wait(every_s)

        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def at(self, t: float) -> tuple[dict[str, float], float]:
        """The last sample at or before ``t``."""
        best: tuple[dict[str, float], float] = ({}, 0.0)
        for ts, cpu, wait in self.samples:
            if ts > t:
                break
            best = (cpu, wait)
        return best


def _child_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_once(
    config: str, steps: int, workdir: Path, api_url: str | None, timeout: float, command: list[str], db_url: str
) -> dict:
    """One ``neuron-flows run``: its lines with arrival times (seconds since start), exit code,
    wall, CPU seconds and the run directory's files' times."""
    run_dir = workdir / "run"
    cmd = [
        *command,
        "run",
        config,
        "--set",
        f"train.max_steps={steps}",
        "--set",
        f"output.dir={run_dir}",
    ]
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.setdefault("OMP_NUM_THREADS", "1")
    if api_url:
        env["PREFECT_API_URL"] = api_url
    lines: list[tuple[float, str]] = []
    cpu0 = _child_cpu_s()
    t0_wall, t0 = time.time(), time.monotonic()
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    sampler = TreeSampler(proc.pid, t0)
    killer = threading.Timer(timeout, os.killpg, (proc.pid, signal.SIGKILL))  # a hung run ends here
    killer.start()
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append((time.monotonic() - t0, line.rstrip("\n")))
    code = proc.wait()
    wall = time.monotonic() - t0
    killer.cancel()
    sampler.stop()
    return {
        "sampler": sampler,
        "database_url": db_url,
        "code": code,
        "wall_s": wall,
        "cpu_s": _child_cpu_s() - cpu0,
        "lines": lines,
        "run_dir": str(run_dir),
        "files": _file_times(run_dir, t0_wall),
        "steps_s": _steps_time(run_dir / "metrics.jsonl"),
    }


def _steps_time(path: Path) -> float:
    if not path.exists():
        return float("nan")
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return sum(r.get("step_time_s", 0.0) for r in rows if "step_time_s" in r)


def _file_times(run_dir: Path, t0_wall: float) -> dict[str, float]:
    """Modification times, in seconds since the command started, of the files that mark phases."""
    out = {}
    job = run_dir / "job.json"
    if job.exists():
        out["job.json"] = job.stat().st_mtime - t0_wall
    for marker in sorted(run_dir.glob("checkpoint-*/COMPLETE")):
        out[f"{marker.parent.name}/COMPLETE"] = marker.stat().st_mtime - t0_wall
    return out


def milestones(run: dict) -> dict[str, float]:
    """The times (seconds since start) of the milestones the breakdown is made of."""
    m: dict[str, float] = {}
    lines = run["lines"]
    if lines:
        m["first line"] = lines[0][0]
        m["last line"] = lines[-1][0]
    for t, line in lines:
        if "Starting temporary server" in line:
            m.setdefault("server starting", t)
        elif "Beginning flow run" in line:
            m.setdefault("flow begun", t)
        elif (done := _TASK_DONE.search(line)) is not None:
            m[f"{done.group(1)} done"] = t
        elif "Task run 'train-" in line and " - start: " in line:
            m.setdefault("first step", t)
        elif (step := _STEP.search(line)) is not None and step.group(1) == step.group(2):
            m["last step"] = t
        elif "Task run 'train-" in line and " - checkpoint: " in line:
            m["checkpoint"] = t
        elif "Flow run '" in line and "Finished in state" in line:
            m["flow done"] = t
    if "job.json" in run["files"]:
        m["job.json"] = run["files"]["job.json"]
    return m


def breakdown(run: dict) -> list[tuple[str, float, float]]:
    """The phases (``PHASES``) as (name, start s, end s); a phase whose end milestone is missing
    is left out and its time falls to the next one found."""
    m = milestones(run)
    ends = [
        ("imports, config, preflight", m.get("server starting", m.get("first line"))),
        ("temporary server start", m.get("flow begun") if "server starting" in m else None),
        ("flow start", m.get("flow begun") if "server starting" not in m else None),
        *[(name if name != "preflight" else "preflight task", m.get(f"{name} done")) for name in TASKS[:3]],
        ("train task set-up", m.get("job.json")),
        ("torchrun + ranks to first step", m.get("first step")),
        ("steps", m.get("last step")),
        ("last step to checkpoint written", m.get("checkpoint")),
        ("ranks' exit", m.get("train done")),
        *[(name, m.get(f"{name} done")) for name in TASKS[4:]],
        ("flow end", m.get("flow done")),
        ("stop server, print", m.get("last line")),
        ("exit after last line", run["wall_s"]),
    ]
    out, prev = [], 0.0
    for name, end in ends:
        if end is None or end < prev:
            continue
        out.append((name, prev, end))
        prev = end
    return out


def summary(run: dict) -> dict:
    """Wall, steps, overhead, CPU, the breakdown (wall, CPU seconds by process kind and seconds
    spent waiting for a core, per phase), and what came after the last summary line."""
    last = max((i for i, (_, x) in enumerate(run["lines"]) if x.startswith("consolidated: ")), default=None)
    after = [x for _, x in run["lines"][last + 1 :]] if last is not None else []
    sampler = run["sampler"]
    phases = {}
    for name, t0, t1 in breakdown(run):
        (cpu0, wait0), (cpu1, wait1) = sampler.at(t0), sampler.at(t1)
        cpu = {k: round(v - cpu0.get(k, 0.0), 2) for k, v in cpu1.items() if v - cpu0.get(k, 0.0) >= 0.01}
        phases[name] = {"wall_s": round(t1 - t0, 2), "cpu_s": cpu, "waited_s": round(wait1 - wait0, 2)}
    cpu_seen, wait_seen = sampler.at(run["wall_s"])
    return {
        "code": run["code"],
        "wall_s": round(run["wall_s"], 2),
        "steps_s": round(run["steps_s"], 2),
        "overhead_s": round(run["wall_s"] - run["steps_s"], 2),
        "cpu_s": round(run["cpu_s"], 1),
        "cpu_seen_s": {k: round(v, 1) for k, v in cpu_seen.items()},
        "waited_s": round(wait_seen, 1),
        "breakdown": phases,
        "lines_after_summary": after,
        "api_logging_error": any("Error logging to API" in x for _, x in run["lines"]),
        "recorded": recorded(run),
    }


def recorded(run: dict) -> dict | None:
    """What the Prefect server's database holds of the run (read after the command exited): the
    flow run's state, its task runs' states, and how many logs and artifacts it has; None where
    the database is not a local SQLite file."""
    import sqlite3

    name = next(
        (re.search(r"Beginning flow run '([^']+)'", x) for _, x in run["lines"] if "Beginning flow run" in x), None
    )
    url = run.get("database_url") or ""
    if name is None or not url.startswith("sqlite"):
        return None
    db = sqlite3.connect(url.split(":///", 1)[1])
    try:
        row = db.execute("select id, state_name from flow_run where name = ?", (name.group(1),)).fetchone()
        if row is None:
            return {"flow_run": None}
        tasks = db.execute("select name, state_name from task_run where flow_run_id = ?", (row[0],)).fetchall()
        logs = db.execute("select count(*) from log where flow_run_id = ?", (row[0],)).fetchone()[0]
        artifacts = db.execute("select count(*) from artifact where flow_run_id = ?", (row[0],)).fetchone()[0]
    finally:
        db.close()
    return {
        "flow_run": row[1],
        "task_runs": {n.rsplit("-", 1)[0]: state for n, state in sorted(tasks)},
        "logs": logs,
        "artifacts": artifacts,
    }


def database_url(env: dict[str, str]) -> str:
    """The database URL of the Prefect server the command uses, under ``env``."""
    code = (
        "from prefect.settings import get_current_settings as s; "
        "print(s().server.database.connection_url.get_secret_value())"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    return out.stdout.strip()


class RunningServer:
    """``prefect server start`` on a free local port with its own PREFECT_HOME (a temporary
    folder), for the runs that use an already running server."""

    def __init__(self, home: Path):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}/api"
        self.database_url = f"sqlite+aiosqlite:///{home}/prefect.db"
        env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
        env.update(PREFECT_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false", PREFECT_UI_ENABLED="false")
        cmd = [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(self.port)]
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )

    def wait(self, timeout: float = 180) -> None:
        from neuron_flows.flows.serve import wait_healthy

        wait_healthy(self.url, self.proc, timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def import_times(targets=IMPORT_TARGETS, top: int = 8) -> dict[str, dict]:
    """``python -X importtime -c 'import T'`` per target in a fresh interpreter: the whole
    import's seconds and the heaviest modules imported directly by the target or by the
    interpreter at its top level (cumulative seconds, nested imports included)."""
    out = {}
    for target in targets:
        proc = subprocess.run(
            [sys.executable, "-X", "importtime", "-c", f"import {target}"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        rows = []
        for line in proc.stderr.splitlines():
            parts = line.removeprefix("import time:").split("|")
            if len(parts) != 3 or not parts[1].strip().isdigit():
                continue
            name = parts[2].rstrip()
            depth = (len(name) - len(name.lstrip())) // 2
            rows.append((depth, name.strip(), int(parts[1]) / 1e6))
        total = next((s for d, n, s in rows if d == 0 and n == target), float("nan"))
        # The target's own direct imports, plus what the interpreter imported at top level.
        heavy = sorted(((s, n) for d, n, s in rows if d <= 1 and n != target), reverse=True)[:top]
        out[target] = {"seconds": round(total, 2), "heaviest": {n: round(s, 2) for s, n in heavy}}
    return out


def _print_table(results: list[dict]) -> None:
    by_kind: dict[str, list[dict]] = {}
    for r in results:
        by_kind.setdefault(r["server"], []).append(r)
    for kind, runs in by_kind.items():
        print(f"\n== {kind}: {len(runs)} run(s)")
        for r in runs:
            s = r["summary"]
            cpu = ", ".join(f"{k} {v:.1f}" for k, v in s["cpu_seen_s"].items())
            print(
                f"   run {r['index']}: exit {s['code']}, wall {s['wall_s']:.1f} s, steps {s['steps_s']:.1f} s, "
                f"overhead {s['overhead_s']:.1f} s, CPU {s['cpu_s']:.1f} s ({cpu}), waited for a core "
                f"{s['waited_s']:.1f} s; load before {r['load_before']}"
            )
            rec = s["recorded"]
            if rec:
                states = sorted(set(rec.get("task_runs", {}).values()))
                print(
                    f"     recorded: flow run {rec['flow_run']}, {len(rec.get('task_runs', {}))} task runs {states}, "
                    f"{rec.get('logs')} logs, {rec.get('artifacts')} artifacts"
                )
            if s["lines_after_summary"] or s["api_logging_error"]:
                print(
                    f"     {len(s['lines_after_summary'])} lines after the summary; "
                    f"'Error logging to API' seen: {s['api_logging_error']}"
                )
        print("  medians:")
        for key in ("wall_s", "steps_s", "overhead_s", "cpu_s"):
            print(f"    {key:<32} {median(r['summary'][key] for r in runs):8.2f}")
        print_table(["breakdown (medians)", "wall s", "waited s", "CPU s by process"], _breakdown_rows(runs))


def _breakdown_rows(runs: list[dict]) -> list[list[str]]:
    """Per phase found in the runs: the medians of its wall time, of the time waited for a core
    and of the CPU seconds of each kind of process."""
    rows = []
    for phase in PHASES:
        found = [r["summary"]["breakdown"][phase] for r in runs if phase in r["summary"]["breakdown"]]
        if not found:
            continue
        kinds = sorted({k for f in found for k in f["cpu_s"]})
        cpu = ", ".join(f"{k} {median(f['cpu_s'].get(k, 0.0) for f in found):.1f}" for k in kinds)
        wall, waited = median(f["wall_s"] for f in found), median(f["waited_s"] for f in found)
        rows.append([phase, f"{wall:.2f}", f"{waited:.2f}", cpu])
    return rows


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, "2 training steps a run instead of 5")
    p.add_argument("--config", default="configs/tiny-llama-cpu.yaml")
    p.add_argument("--steps", type=int, help="training steps a run (default 5)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--server", choices=["temporary", "running", "both"], default="temporary")
    p.add_argument("--imports", action="store_true", help="also python -X importtime of the modules the run loads")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--keep", action="store_true", help="keep the run directories (printed)")
    p.add_argument("--json", help="write every run (lines with times included) to this file")
    p.add_argument("--show", action="store_true", help="print each run's output lines with their times")
    p.add_argument(
        "--command",
        action="append",
        help="the command to measure (default: the installed neuron-flows); given twice or more, the "
        "commands alternate in each repeat, e.g. --command neuron-flows --command 'python old_cli.py'",
    )
    args = p.parse_args(argv)
    args.steps = pick(args.steps, args.quick, 2, 5)
    if not (ROOT / ".tiny" / "model" / "config.json").exists() and "tiny" in args.config:
        subprocess.run([str(BIN / "neuron-flows"), "make-tiny", ".tiny"], cwd=ROOT, check=True)
    kinds = ["temporary", "running"] if args.server == "both" else [args.server]
    commands = [shlex.split(c) for c in args.command or [str(BIN / "neuron-flows")]]
    temporary_db = database_url({k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"})
    work = Path(tempfile.mkdtemp(prefix="flow-overhead-"))
    server = None
    results = []
    load_start = os.getloadavg()
    try:
        if "running" in kinds:
            server = RunningServer(work / "prefect-home")
            server.wait()
        for i in range(args.repeats):
            for kind, (c, command) in itertools.product(kinds, enumerate(commands)):
                workdir = work / f"{kind}-{c}-{i}"
                label = kind if len(commands) == 1 else f"{kind}, command {c + 1} ({shlex.join(command)})"
                load = loadavg()
                api = server.url if kind == "running" else None
                db_url = server.database_url if server is not None and kind == "running" else temporary_db
                run = run_once(args.config, args.steps, workdir, api, args.timeout, command, db_url)
                run_summary = summary(run)
                del run["sampler"]
                results.append({"server": label, "index": i, "load_before": load, "summary": run_summary, **run})
                if args.show:
                    print(f"--- {kind} run {i}")
                    for t, line in run["lines"]:
                        print(f"{t:7.2f} {line[:200]}")
                s = run_summary
                print(
                    f"[{time.strftime('%H:%M:%S')}] {label} run {i}: exit {s['code']}, wall {s['wall_s']:.1f} s, "
                    f"overhead {s['overhead_s']:.1f} s, CPU {s['cpu_s']:.1f} s, load before {load}",
                    flush=True,
                )
    finally:
        if server is not None:
            server.stop()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"run directories kept under {work}")
    _print_table(results)
    imports = import_times() if args.imports else None
    if imports:
        print("\n== python -X importtime (fresh interpreter each)")
        for target, info in imports.items():
            heavy = ", ".join(f"{n} {s:.2f}" for n, s in info["heaviest"].items())
            print(f"  {target:<30} {info['seconds']:6.2f} s   heaviest: {heavy}")
    load_end = os.getloadavg()
    print(
        f"\nload average before {load_start[0]:.2f} {load_start[1]:.2f} {load_start[2]:.2f}, "
        f"after {load_end[0]:.2f} {load_end[1]:.2f} {load_end[2]:.2f}; cores {os.cpu_count()}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": results, "imports": imports}, indent=1))
    return 0 if all(r["code"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
