"""The run's summary as markdown: the loss curve, losses, throughput, layout and links to what
the run made (checkpoints, consolidated model, Hub commit, trackers)."""

import base64
import json
from pathlib import Path

from neuron_parallel.checkpoint import list_checkpoints
from neuron_parallel.hub import HubCommit
from neuron_parallel.launch import TrainResult
from neuron_parallel.planning.layout import CheckedLayout, describe_layout
from neuron_parallel.run_files import MLFLOW_RUN_FILE, TENSORBOARD_DIR


def summary_markdown(
    result: TrainResult,
    layout: CheckedLayout,
    checkpoint: str,
    model_dir: str,
    commit: HubCommit | None,
    metrics: list[dict],
    png: bytes,
    since_previous: str | None = None,
) -> str:
    first, last = metrics[0], metrics[-1]
    pc = layout.parallel
    hub = (
        f"[{commit.url}]({commit.url}) (revision `{commit.revision}`)" if commit else "not uploaded (no `hub.repo_id`)"
    )
    resumed = f", resumed from step {result.resumed_from_step}" if result.resumed_from_step else ""
    checkpoints = list_checkpoints(result.run_dir)
    lines = [
        "# Fine-tune summary",
        "",
        f"![loss curve](data:image/png;base64,{base64.b64encode(png).decode()})",
        "",
        "| item | value |",
        "|---|---|",
        f"| steps | {result.final_step}{resumed} |",
        f"| loss | {first['loss']:.4f} (step {first['step']}) → {last['loss']:.4f} (step {last['step']}) |",
        *eval_rows(metrics),
        f"| tokens seen | {last.get('tokens_seen', 0):,} |",
        f"| throughput (last step) | {last.get('tokens_per_s', 0):,.0f} tokens/s |",
        f"| layout | {describe_layout(pc)}, micro batch {layout.micro_batch_size} × accumulation {layout.grad_accum} |",
        f"| run directory | [{result.run_dir}](file://{Path(result.run_dir).resolve()}) |",
        f"| checkpoints | {', '.join(f'[{p.name}](file://{p.resolve()})' for p in checkpoints) or 'none kept'} |",
        f"| validated checkpoint | [{checkpoint}](file://{Path(checkpoint).resolve()}) |",
        f"| consolidated model | [{model_dir}](file://{Path(model_dir).resolve()}) |",
        f"| Hub | {hub} |",
        *([f"| model and data revisions | {since_previous} |"] if since_previous else []),
        *tracker_rows(Path(result.run_dir)),
    ]
    return "\n".join(lines) + "\n"


def tracker_rows(run_dir: Path) -> list[str]:
    """Where else the metrics are: the TensorBoard command and the MLflow run, when the run reported there."""
    rows = []
    if (run_dir / TENSORBOARD_DIR).is_dir():
        rows.append(f"| TensorBoard | `tensorboard --logdir {(run_dir / TENSORBOARD_DIR).resolve()}` |")
    if (run_dir / MLFLOW_RUN_FILE).is_file():
        saved = json.loads((run_dir / MLFLOW_RUN_FILE).read_text())
        rows.append(f"| MLflow | run `{saved['run_id']}` in `{saved['tracking_uri']}` |")
    return rows


def eval_rows(metrics: list[dict]) -> list[str]:
    """The summary's eval lines: the first and last eval loss, and the best."""
    evals = [m for m in metrics if "eval_loss" in m]
    if not evals:
        return ["| eval loss | no eval data (set data.eval_fraction, data.eval_split or data.eval_source) |"]
    first, last = evals[0], evals[-1]
    best = min(evals, key=lambda m: m["eval_loss"])
    return [
        f"| eval loss | {first['eval_loss']:.4f} (step {first['step']}) → {last['eval_loss']:.4f} "
        f"(step {last['step']}); best {best['eval_loss']:.4f} (step {best['step']}) |"
    ]
