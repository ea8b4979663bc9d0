"""The run's summary: a markdown artifact with the loss curve and links to what the run made."""

import base64
import io
import json
from pathlib import Path

from prefect import task
from prefect.artifacts import create_markdown_artifact

from neuron_parallel.hub import HubCommit
from neuron_parallel.launch import TrainResult
from neuron_parallel.planning.layout import CheckedLayout
from neuron_parallel.reporting import MLFLOW_RUN_FILE, TENSORBOARD_DIR, read_metrics, tag_mlflow_run

from .common import STEP_POLICY


def loss_curve_png(metrics: list[dict]) -> bytes:
    """Loss (and learning rate) per optimizer step as a PNG."""
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


def summary_markdown(
    result: TrainResult,
    layout: CheckedLayout,
    checkpoint: str,
    model_dir: str,
    commit: HubCommit | None,
    metrics: list[dict],
    png: bytes,
) -> str:
    first, last = metrics[0], metrics[-1]
    pc = layout.parallel
    hub = (
        f"[{commit.url}]({commit.url}) (revision `{commit.revision}`)" if commit else "not uploaded (no `hub.repo_id`)"
    )
    resumed = f", resumed from step {result.resumed_from_step}" if result.resumed_from_step else ""
    checkpoints = sorted(Path(result.run_dir).glob("checkpoint-*[0-9]"), key=lambda p: int(p.name.split("-")[1]))
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
        f"| layout | dp={pc.dp} tp={pc.tp} pp={pc.pp}{' zero-1' * pc.zero_1}{' sp' * pc.sequence_parallel}, "
        f"micro batch {layout.micro_batch_size} × accumulation {layout.grad_accum} |",
        f"| run directory | [{result.run_dir}](file://{Path(result.run_dir).resolve()}) |",
        f"| checkpoints | {', '.join(f'[{p.name}](file://{p.resolve()})' for p in checkpoints) or 'none kept'} |",
        f"| validated checkpoint | [{checkpoint}](file://{Path(checkpoint).resolve()}) |",
        f"| consolidated model | [{model_dir}](file://{Path(model_dir).resolve()}) |",
        f"| Hub | {hub} |",
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


@task(name="report", **STEP_POLICY)
def report(
    result: TrainResult, layout: CheckedLayout, checkpoint: str, model_dir: str, commit: HubCommit | None
) -> str:
    """Write ``loss_curve.png`` into the run directory and the summary artifact, and tag the run's MLflow
    run (if any) with the consolidated model and Hub URL; returns the summary's markdown."""
    path = Path(result.run_dir) / "metrics.jsonl"
    metrics = read_metrics(path)
    png = loss_curve_png(metrics)
    (Path(result.run_dir) / "loss_curve.png").write_bytes(png)
    markdown = summary_markdown(result, layout, checkpoint, model_dir, commit, metrics, png)
    tags = {"consolidated_model": str(Path(model_dir).resolve()), **({"hub_url": commit.url} if commit else {})}
    tag_mlflow_run(result.run_dir, tags)  # when the run reported to MLflow: where its model went
    create_markdown_artifact(key="summary", markdown=markdown, description="Loss curve, checkpoints, model, Hub commit")
    return markdown
