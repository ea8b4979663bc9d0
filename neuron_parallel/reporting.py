"""Where each step's metrics go besides ``metrics.jsonl``: TensorBoard event files and an MLflow
run (``train.report_to``); the estimate of the time left that step events carry; reading
``metrics.jsonl`` back (``read_metrics``) and drawing its loss curve (``loss_curve_png``). The
run directory's file names are ``neuron_parallel.run_files``'.

Only global rank 0 reports: every record it holds is the one it writes to ``metrics.jsonl``
(losses are all-reduced, so rank 0 holds them whatever the layout, pipeline stages included).

* **TensorBoard**: ``<run dir>/tensorboard/`` through ``torch.utils.tensorboard.SummaryWriter``,
  flushed after every step so a crash loses nothing already trained. A (re)start at step ``s``
  opens its writer with ``purge_step = s + 1``: readers drop the steps past ``s`` that an
  interrupted run had logged, so the event files hold one value per step, as ``metrics.jsonl``.
* **MLflow**: the run in ``MLFLOW_TRACKING_URI`` (else a SQLite store, ``<run dir>/mlflow.db``),
  in experiment ``MLFLOW_EXPERIMENT_NAME`` (else ``neuron-flows``). The config goes in as params
  (flattened, ``train.lr``), every step's scalars as metrics. The run id is kept in
  ``<run dir>/mlflow_run.json``, so a resumed run continues the same MLflow run; MLflow keeps every
  value it was sent, so steps an interrupted run logged past its last checkpoint appear twice in
  the metric history (the later value is the one ``metrics.jsonl`` keeps). mlflow is imported only
  when asked for (its import takes seconds).
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

from .run_files import MLFLOW_ARTIFACTS_DIR, MLFLOW_DB, MLFLOW_RUN_FILE, TENSORBOARD_DIR

SCALARS = {
    "loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "tokens_per_s": "train/tokens_per_s",
    "step_time_s": "train/step_time_s",
    "eval_loss": "eval/loss",
    "peak_memory_bytes": "memory/peak_bytes",
}
"""Record field → tag (TensorBoard) and metric name (MLflow)."""
MLFLOW_EXPERIMENT = "neuron-flows"
_MAX_PARAM_CHARS = 6000  # MLflow refuses longer param values (mlflow.utils.validation.MAX_PARAM_VAL_LENGTH)


def peak_memory_bytes(device) -> int | None:
    """This process's peak memory in bytes on ``device`` (a device type such as ``"cuda"``, or a
    ``torch.device``, whose index is read; the current device otherwise).

    * cpu: the peak resident set size (CPU tensors have no allocator statistics; ``memprof``
      measures tensors alone, slowly);
    * an accelerator: its allocator's peak from the device's own module (``torch.cuda``;
      ``torch.neuron`` where torch-neuronx provides ``max_memory_allocated``), read after
      synchronizing the device so that queued work is counted (AWS's advice for neuron); failing
      that from ``torch.accelerator``, whose memory API needs a registered device allocator;
      None where neither has the statistics: no figure rather than a wrong one.

    The synchronize waits for the device's queue to drain: read it at log steps, not every step."""
    kind = device if isinstance(device, str) else device.type
    if kind == "cpu":
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(peak if sys.platform == "darwin" else peak * 1024)  # bytes on macOS, KiB on Linux
    import torch

    from .step_log import synchronize

    index = () if isinstance(device, str) or device.index is None else (device.index,)
    module = getattr(torch, kind, None)
    if module is not None and hasattr(module, "max_memory_allocated"):
        synchronize(device)
        return int(module.max_memory_allocated(*index))
    try:
        synchronize(device)
        return int(torch.accelerator.max_memory_allocated(*index))
    except (AttributeError, RuntimeError):  # no accelerator API, no such device, or no allocator registered
        return None


def flat_params(config: Any, prefix: str = "") -> dict[str, str]:
    """A (dataclass or dict) config as ``{"section.field": "value"}``, nested sections joined by dots."""
    if dataclasses.is_dataclass(config):
        config = dataclasses.asdict(config)
    out: dict[str, str] = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            out.update(flat_params(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = str(value)[:_MAX_PARAM_CHARS]
    return out


class MetricsReporter:
    """Sends step records to the trackers of ``report_to``; does nothing when that is empty (and on
    every rank but 0: build it with :func:`metrics_reporter`). A context manager: leaving it ends
    the trackers' runs, as failed when an exception leaves it."""

    def __init__(
        self, run_dir: str | Path, report_to: list[str], *, start_step: int, params: dict[str, str] | None = None
    ) -> None:
        run_dir = Path(run_dir)
        self.sinks: list[_TensorBoard | _MLflow] = []
        if "tensorboard" in report_to:
            self.sinks.append(_TensorBoard(run_dir / TENSORBOARD_DIR, start_step))
        if "mlflow" in report_to:
            self.sinks.append(_MLflow(run_dir, start_step, params or {}))

    def log(self, record: dict) -> None:
        """Report the scalars of one step's record (see :data:`SCALARS`)."""
        values = {tag: float(record[key]) for key, tag in SCALARS.items() if record.get(key) is not None}
        for sink in self.sinks:
            sink.log(record["step"], values)

    def close(self, failed: bool = False) -> None:
        for sink in self.sinks:
            sink.close(failed)
        self.sinks = []

    def __enter__(self) -> MetricsReporter:
        return self

    def __exit__(self, kind, value, tb) -> None:
        self.close(failed=kind is not None)


def metrics_reporter(job, *, rank: int, start_step: int) -> MetricsReporter:
    """The reporter of ``job`` (a ``JobConfig``) on this rank: ``train.report_to`` on rank 0, none
    elsewhere. The params MLflow records are the job's config, flattened."""
    report_to = job.train.report_to if rank == 0 else []
    params = flat_params(job) if "mlflow" in report_to else None
    return MetricsReporter(job.output_dir, report_to, start_step=start_step, params=params)


class _TensorBoard:
    def __init__(self, log_dir: Path, start_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        log_dir.mkdir(parents=True, exist_ok=True)
        _wait_for_a_new_second(log_dir)
        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=start_step + 1)

    def log(self, step: int, values: dict[str, float]) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, global_step=step)
        self.writer.flush()

    def close(self, failed: bool) -> None:
        self.writer.close()


def _wait_for_a_new_second(log_dir: Path) -> None:
    """Readers take a folder's event files in name order, and a name starts with its creation time
    in whole seconds, then host and process id; a file created in the same second as an earlier
    one could sort before it (and its purge would come too early), so wait for the next second."""
    names = [p.name.split(".") for p in log_dir.glob("events.out.tfevents.*")]
    stamps = [int(parts[3]) for parts in names if len(parts) > 4 and parts[3].isdigit()]
    while stamps and int(time.time()) <= max(stamps):
        time.sleep(0.05)


def tracking_uri(run_dir: str | Path) -> str:
    """``MLFLOW_TRACKING_URI`` if set, else the SQLite store in the run directory."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path(run_dir).resolve() / MLFLOW_DB}"


class _MLflow:
    def __init__(self, run_dir: Path, start_step: int, params: dict[str, str]) -> None:
        try:
            from mlflow.tracking import MlflowClient
        except ImportError:
            raise ValueError(
                "train.report_to lists mlflow, which is not installed; install it (pip install "
                "'neuron-flows[mlflow]', or mlflow-skinny) or drop mlflow from train.report_to"
            ) from None
        self.uri = tracking_uri(run_dir)
        self.client = MlflowClient(self.uri)
        self.run_id = _existing_run(self.client, run_dir, self.uri)
        if self.run_id is None:
            self.run_id = self._create_run(run_dir)
            (run_dir / MLFLOW_RUN_FILE).write_text(json.dumps({"tracking_uri": self.uri, "run_id": self.run_id}))
            _log_params(self.client, self.run_id, params, {})
        else:
            self.client.update_run(self.run_id, status="RUNNING")
            self.client.set_tag(self.run_id, "resumed_from_step", str(start_step))
            _log_params(self.client, self.run_id, params, self.client.get_run(self.run_id).data.params)

    def _create_run(self, run_dir: Path) -> str:
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or MLFLOW_EXPERIMENT
        experiment = self.client.get_experiment_by_name(name)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        elif os.environ.get("MLFLOW_TRACKING_URI"):
            experiment_id = self.client.create_experiment(name)
        else:  # the store's default artifact root is relative to the working directory: keep it in the run
            artifacts = (run_dir / MLFLOW_ARTIFACTS_DIR).as_uri()
            experiment_id = self.client.create_experiment(name, artifact_location=artifacts)
        tags = {"run_dir": str(run_dir.resolve()), "mlflow.source.name": "neuron-flows"}
        return self.client.create_run(experiment_id, run_name=run_dir.resolve().name, tags=tags).info.run_id

    def log(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(tag, v, now, step) for tag, v in values.items()])

    def close(self, failed: bool) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


def _existing_run(client, run_dir: Path, uri: str) -> str | None:
    """The run id this run directory recorded for this tracking URI, if that run still exists."""
    path = run_dir / MLFLOW_RUN_FILE
    saved = json.loads(path.read_text()) if path.is_file() else {}
    if saved.get("tracking_uri") != uri or not saved.get("run_id"):
        return None
    from mlflow.exceptions import MlflowException

    try:
        return client.get_run(saved["run_id"]).info.run_id
    except MlflowException:
        return None


def _log_params(client, run_id: str, params: dict[str, str], logged: dict[str, str]) -> None:
    """Log the params not logged yet. MLflow params cannot change, so a value that differs from the
    one logged before (a resume with, say, more steps) is recorded as a ``resume.<name>`` tag."""
    from mlflow.entities import Param, RunTag

    new = [Param(k, v) for k, v in params.items() if k not in logged]
    changed = [RunTag(f"resume.{k}", v) for k, v in params.items() if k in logged and logged[k] != v]
    client.log_batch(run_id, params=new, tags=changed)


def report_evaluation(
    run_dir: str | Path, report_to: list[str], *, step: int, figures: dict[str, float], texts: dict[str, str]
) -> None:
    """The evaluate step's ``figures`` (as ``evaluate/<figure>``) and ``texts`` (markdown, by tag)
    at ``step`` to the trackers of ``report_to``: TensorBoard (a writer of its own in the run's
    folder, text under its tag) and the run's MLflow run (the one training reported to, else a new
    one; text as the artifact ``<tag>.md``)."""
    run_dir = Path(run_dir)
    # MLflow takes letters, digits and _ - . / space in a metric name; lm-eval filter names may hold others.
    values = {
        "evaluate/" + "".join(c if c.isalnum() or c in "_-./ " else "_" for c in k): v for k, v in figures.items()
    }
    if "tensorboard" in report_to:
        board = _TensorBoard(run_dir / TENSORBOARD_DIR, step)
        board.log(step, values)
        for tag, text in texts.items():
            board.writer.add_text(tag, text, global_step=step)
        board.close(False)
    if "mlflow" in report_to:
        if not (run_dir / MLFLOW_RUN_FILE).is_file():
            _MLflow(run_dir, step, {}).close(False)  # creates the run and records it there
        from mlflow.entities import Metric
        from mlflow.tracking import MlflowClient

        saved = json.loads((run_dir / MLFLOW_RUN_FILE).read_text())
        client = MlflowClient(saved["tracking_uri"])
        now = int(time.time() * 1000)
        client.log_batch(saved["run_id"], metrics=[Metric(k, float(v), now, step) for k, v in values.items()])
        for tag, text in texts.items():
            client.log_text(saved["run_id"], text, f"{tag}.md")


def tag_mlflow_run(run_dir: str | Path, tags: dict[str, str]) -> str | None:
    """Set ``tags`` (e.g. where the consolidated model went) on the MLflow run of ``run_dir``; the
    run id, or None when the run did not report to MLflow."""
    path = Path(run_dir) / MLFLOW_RUN_FILE
    if not path.is_file():
        return None
    from mlflow.entities import RunTag
    from mlflow.tracking import MlflowClient

    saved = json.loads(path.read_text())
    client = MlflowClient(saved["tracking_uri"])
    client.log_batch(saved["run_id"], tags=[RunTag(k, str(v)) for k, v in tags.items()])
    return saved["run_id"]


class EtaClock:
    """The time left to ``max_steps``: the mean wall time per step since this (re)start times the
    steps left. Wall time between steps counts evaluations and checkpoint saves too, which recur;
    the first step after a start (warm-up: allocations, caches, first data reads) is left out of
    the mean once a second step is done."""

    def __init__(self, start_step: int, max_steps: int) -> None:
        self.max_steps = max_steps
        self.first: tuple[int, float] = (start_step, time.perf_counter())
        self.warm = False

    def eta_s(self, step: int) -> float:
        """Seconds left once ``step`` is done (call when it is, for any subset of the steps)."""
        now = time.perf_counter()
        first_step, t_first = self.first
        per_step = (now - t_first) / max(step - first_step, 1)
        if not self.warm:  # from now on, measure from the end of this (first timed) call
            self.first, self.warm = (step, now), True
        return per_step * max(self.max_steps - step, 0)


def format_duration(seconds: float) -> str:
    """``45s``, ``1m23s``, ``2h05m``, ``3d04h``: two units at most, for progress lines."""
    s = max(int(round(seconds)), 0)
    days, s = divmod(s, 86400)
    hours, s = divmod(s, 3600)
    minutes, s = divmod(s, 60)
    if days:
        return f"{days}d{hours:02d}h"
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{s:02d}s" if minutes else f"{s}s"


def read_metrics(path: str | Path) -> list[dict]:
    """The records of a ``metrics.jsonl``, skipping a line that is not a whole record (the torn
    tail of a write cut short by a crash, power loss or a full disk)."""
    records = []
    for line in Path(path).read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and "step" in record:
            records.append(record)
    return records


def loss_curve_png(metrics: list[dict]) -> bytes:
    """The loss (train, and eval where recorded) and the learning rate per optimizer step of
    ``metrics`` (``read_metrics``' records) as a PNG: the run summary embeds it and the model card
    shows it (``run_files.LOSS_CURVE_FILE``). matplotlib is imported only here."""
    import matplotlib

    matplotlib.use("Agg")  # no display; must precede pyplot
    import matplotlib.pyplot as plt

    steps = [m["step"] for m in metrics]
    fig, ax = plt.subplots(figsize=(7, 3.2), dpi=90)
    ax.plot(steps, [m["loss"] for m in metrics], color="tab:blue", lw=1.5, label="train")
    evals = [m for m in metrics if "eval_loss" in m]
    if evals:
        eval_steps = [m["step"] for m in evals]
        ax.plot(eval_steps, [m["eval_loss"] for m in evals], "o-", color="tab:green", lw=1.5, label="eval")
        ax.legend(loc="upper center", frameon=False)
    ax.set_xlabel("step")
    ax.set_ylabel("loss", color="tab:blue")
    ax.grid(alpha=0.3)
    lr = ax.twinx()
    lr.plot(steps, [m["lr"] for m in metrics], color="tab:orange", lw=1, alpha=0.7)
    lr.set_ylabel("learning rate", color="tab:orange")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def format_event(event: dict) -> str:
    """One progress event of the ranks (``neuron_parallel.train``'s ``emit``) as the line the CLI
    prints and the train step logs."""
    kind, fields = event["event"], {k: v for k, v in event.items() if k != "event"}
    if kind == "step":
        eta = f" eta {format_duration(event['eta_s'])}" if "eta_s" in event else ""
        return (
            f"step {event['step']}/{event['max_steps']} loss {event['loss']:.4f} "
            f"lr {event['lr']:.2e} {event['tokens_per_s']:.0f} tok/s{eta}"
        )
    if kind == "eval":
        return f"step {event['step']} eval loss {event['eval_loss']:.4f} ({event['eval_tokens']} tokens)"
    if kind == "early_stop":
        return f"early stop at step {event['step']}: {event['reason']}"
    if kind == "resumed":
        return f"resumed from step {event['step']} ({event['checkpoint']})"
    if kind == "memory":
        return "; ".join(
            f"rank {r['rank']} peak tensor memory {r['measured_bytes'] / 2**20:.1f} MiB, predicted "
            f"{r['predicted_bytes'] / 2**20:.1f} MiB ({100 * (r['predicted_bytes'] / r['measured_bytes'] - 1):+.1f}%)"
            for r in event["ranks"]
        )
    return f"{kind}: {json.dumps(fields, ensure_ascii=False)}"
