"""The pipeline's steps as plain functions, without Prefect: each Prefect task of this package
wraps one (retries, caching, artifacts, logging), and ``neuron-flows train`` calls preflight,
tokenize, plan and train in order, so the pipeline is written once.

Each step takes the run's :class:`FinetuneConfig` and what the steps before it returned, and
``log``, where its lines go (``print`` for the command, the run logger for a task). A bad input
raises ``ValueError`` naming the key and the fix.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from .config import FinetuneConfig

if TYPE_CHECKING:
    from neuron_parallel.data import TokenizedDataset
    from neuron_parallel.hub import HubCommit
    from neuron_parallel.launch import TrainResult
    from neuron_parallel.planning.layout import CheckedLayout
    from neuron_parallel.planning.search import LayoutSearch
    from neuron_parallel.promotion import Evaluation

Log = Callable[[str], None]
GiB = 1 << 30


def _quiet(line: str) -> None:
    """The default ``log``: lines are dropped."""


def model_dir(config: FinetuneConfig) -> str:
    """The local directory of the run's model (a Hub name fetched into the cache first)."""
    from neuron_parallel.models import resolve_model_dir

    return resolve_model_dir(config.model.name_or_path, config.model.revision)


def preflight(
    config: FinetuneConfig, *, hub_token: str | None = None, check_upload: bool = False, warn: Log = _quiet
) -> FinetuneConfig:
    """Refuse, before any data is read or any rank starts, what the machine, the model's or the
    data's files or the Hub already show cannot work: the device, the data files, a Hub model or
    dataset that cannot be read here (missing, misspelt, gated, or neither on a reachable Hub nor
    in the cache: ``checks.pin_hub_revisions``), a local model directory and the layout on it,
    on cuda and neuron the host (the stack and one rank on the device: ``tasks.doctor.check_host``),
    and (``check_upload``) the Hub endpoint with ``hub_token``. A Hub model's files are checked by
    the plan step once fetched. What runs but slower or with more memory
    than it could (a ``data.block_size`` that keeps neuron off its flash attention kernel) goes to
    ``warn``, a line, never a refusal. First of all, the run's output folders: ``output.dir`` and
    ``output.consolidated_dir`` (their ``{flow_run…}`` names filled in) must be new, empty or
    created by neuron-flows; last, the evaluation's inputs (:func:`check_evaluation`). Returns the
    config with the revision of every Hub name in it resolved to a commit, which the later steps
    read and the run records; a commit taken from the local cache (``HF_HUB_OFFLINE=1``, or the
    Hub unreachable) is said in ``warn``."""
    from neuron_parallel.checkpoint.output import check_replaceable_dir, check_run_dir
    from neuron_parallel.checks import check_device, check_hub, check_model_dir, pin_hub_revisions
    from neuron_parallel.models import resolve_model_dir
    from neuron_parallel.planning.attention import block_size_advice
    from neuron_parallel.planning.model import ModelShape
    from neuron_parallel.sources import local_data_files
    from neuron_parallel.utils import names_local_path

    check_run_dir(config.output.dir)
    check_replaceable_dir(config.consolidated_path, key="output.consolidated_dir")
    check_device(config.to_launch())
    for source in (config.data.source, config.data.eval_source):
        if source is not None:
            local_data_files(source)
    model, data = pin_hub_revisions(config.library("model"), config.library("data"), warn=warn)
    config = config.model_copy(
        update={
            "model": config.model.model_copy(update={"revision": model.revision}),
            "data": config.data.model_copy(update={"revision": data.revision}),
        }
    )
    name = config.model.name_or_path
    if Path(name).expanduser().exists() or names_local_path(name):
        local = resolve_model_dir(name)  # a local path: refused here if it is not a model directory
        check_model_dir(local)
        plan(config, local)
        head_dim = ModelShape.from_config(local).head_dim
    else:
        head_dim = None
    if config.launch.device != "cpu":  # the quick part of `neuron-flows doctor`: the stack and one rank
        from .doctor import check_host

        check_host(config, plan)
    if check_upload and config.hub.repo_id:
        check_hub(config.hub.endpoint, config.hub.repo_id, hub_token)
    check_evaluation(config)
    cp = config.pinned().get("cp", 1)  # an auto cp is chosen by the plan, whose notes say the same
    advice = block_size_advice(
        config.launch.device, config.library("data").documents, config.data.block_size, head_dim, cp
    )
    if advice:
        warn(f"preflight: warning: {advice}")
    return config


def tokenize(config: FinetuneConfig, log: Log = _quiet) -> TokenizedDataset:
    """Tokenize, mask and pack the run's data (cached by fingerprint); logs the audit's summary."""
    from neuron_parallel.audit import audit_summary
    from neuron_parallel.data import tokenize_data

    ds = tokenize_data(config.library("data"), model_dir(config))
    log(
        f"data: {ds.num_blocks} rows of {ds.block_size} tokens ({ds.attention} attention), "
        f"fingerprint {ds.fingerprint}; {audit_summary(ds.audit)}"
    )
    for source in ds.audit.get("lineage", {}).values():
        if isinstance(source, dict) and source.get("cached"):
            where = f"at commit {source['commit']} from the local Hugging Face cache ({source['cached']})"
            log(f"data: {source['key']} {source['repo']} read {where}")
    return ds


def needs_reference(config: FinetuneConfig) -> bool:
    """Whether the run has a :func:`reference` step (``preference.needs_reference``)."""
    from neuron_parallel.preference import needs_reference as needs

    train = config.library("train", micro_batch_size=1)
    return needs(train.objective, train.lora)


def reference(config: FinetuneConfig, dataset: TokenizedDataset, log: Log = _quiet) -> str | None:
    """The reference log-probabilities of DPO fully fine-tuned (``preference.compute_reference``):
    the folder beside the tokenized rows, computed once per data fingerprint and reference weights'
    digest and reused after (a retry, a recurring run). None where the objective needs none (sft,
    simpo, orpo, or dpo under LoRA, whose reference is the base with its adapters off)."""
    from neuron_parallel.preference import compute_reference

    if not needs_reference(config):
        return None
    path = compute_reference(model_dir(config), dataset.path, dataset.eval_path)
    log(f"reference: log-probabilities of {model_dir(config)} for data {dataset.fingerprint} in {path}")
    return str(path)


def plan(
    config: FinetuneConfig, model: str, dataset_path: str = "", log: Log = _quiet
) -> tuple[CheckedLayout, LayoutSearch | None]:
    """The layout this run trains with on the model in directory ``model``, checked against it,
    and the search that chose it (None when the config pinned every planned field)."""
    from neuron_parallel.planning.layout import check_layout
    from neuron_parallel.planning.resolve import resolve_layout

    resolved = config.pinned_layout() or resolve_layout(
        model,
        config.pinned(),
        launch=config.to_launch(),
        hardware=config.launch.hardware,
        seq_len=config.data.block_size,
        global_batch_size=config.train.global_batch_size,
        mixed_precision=config.parallel.mixed_precision,
        layer_split=config.parallel.layer_split,
        lora=config.library("train", micro_batch_size=1).lora,
        memory_fraction=config.launch.memory_fraction,
        documents=config.library("data").documents,
        objective=config.train.objective,
    )
    checked = check_layout(config.to_job(model_path=model, dataset_path=dataset_path, layout=resolved))
    best = resolved.chosen
    if best is None:
        log(f"plan: given in the config: {'; '.join(checked.notes)}")
        return checked, None
    checked = dataclasses.replace(
        checked,
        predicted_memory_bytes=best.memory_per_rank_bytes,
        predicted_tokens_per_s=best.tokens_per_s,
        notes=[*checked.notes, f"chosen by the planner for {config.hardware}: {best.describe()}"],
    )
    log(f"plan: {checked.notes[-1]}, predicted {checked.predicted_memory_bytes / GiB:.2f} GiB per rank")
    return checked, resolved.search


def train(
    config: FinetuneConfig,
    dataset: TokenizedDataset,
    layout: CheckedLayout,
    *,
    on_event: Callable[[dict], None],
    log: Log = _quiet,
    on_line: Log = _quiet,
    reference_path: str | None = None,
) -> TrainResult:
    """Train under torchrun (ranks started ahead with the same launch are used); resumes from
    the newest complete checkpoint in ``output.dir``, so it is safe to run again, unless that
    checkpoint was trained on another model or other data (refused: ``lineage.check_resume``). The
    job carries the run's ``lineage``, which every checkpoint's trainer state records. On a multi-node
    launch with ``NEURON_FLOWS_LAUNCH_FILE`` set, the job is published there first for the other
    nodes' ``neuron-flows join``. ``on_event`` gets the ranks' progress events, ``on_line`` every
    other line they print. ``reference_path``: the :func:`reference` step's folder (DPO fully
    fine-tuned)."""
    from neuron_parallel.launch import LAUNCH_FILE_ENV, publish_launch, run_torchrun
    from neuron_parallel.lineage import check_resume, model_identity, run_lineage

    model_path = model_dir(config)
    job = config.to_job(
        model_path=model_path,
        dataset_path=dataset.path,
        eval_dataset_path=dataset.eval_path,
        layout=layout,
        reference_path=reference_path,
    )
    data = dataset.audit.get("lineage") or {"fingerprint": dataset.fingerprint}
    lineage = run_lineage(model_identity(config.model.name_or_path, model_path), data)
    check_resume(config.output.dir, lineage)  # before any rank starts
    job = dataclasses.replace(job, lineage=lineage)
    launch = config.to_launch()
    if launch.nnodes > 1 and os.environ.get(LAUNCH_FILE_ENV):
        publish_launch(os.environ[LAUNCH_FILE_ENV], job, launch)
        log(f"published the launch for {launch.nnodes - 1} more nodes at {os.environ[LAUNCH_FILE_ENV]}")
    return run_torchrun(job, launch, on_event=on_event, on_line=on_line)


def validate(run_dir: str, log: Log = _quiet) -> str:
    """The newest complete checkpoint of ``run_dir``, every file checked against its manifest;
    raises ``ValueError`` listing what is wrong."""
    from neuron_parallel.checkpoint import resolve_checkpoint, validate_checkpoint

    ckpt = resolve_checkpoint(run_dir)
    problems = validate_checkpoint(ckpt)
    if problems:
        raise ValueError(f"checkpoint {ckpt} is invalid:\n" + "\n".join(problems))
    log(f"checkpoint {ckpt} is valid")
    return str(ckpt)


def consolidate(config: FinetuneConfig, checkpoint: str, log: Log = _quiet) -> str:
    """The checkpoint as a Hugging Face model directory for ``output.consolidated_dir`` (LoRA runs:
    the peft adapter, the merged model or both, as ``hub.upload`` says), written beside it
    (``checkpoint/output.py``, ``staged_dir``): an earlier run's model there stays as it is until
    :func:`upload` has published this one and puts it in place. Returns ``output.consolidated_dir``."""
    from neuron_parallel.checkpoint import export_checkpoint
    from neuron_parallel.checkpoint.output import stage_output_dir
    from neuron_parallel.hub import published_name  # the adapter's config is published: no local path

    final = config.consolidated_path
    staged = stage_output_dir(final, key="output.consolidated_dir")
    formats = {"fmt": config.output.format, "max_shard_size": config.output.max_shard_size}
    if config.train.lora is None:
        export_checkpoint(checkpoint, staged, kind="full", **formats)
    else:
        base = {
            "base_model_name": published_name(config.model.name_or_path),
            "base_model_revision": config.model.revision,
        }
        export_checkpoint(checkpoint, staged, kind=config.hub.upload, **base, **formats)
    log(f"consolidated {checkpoint} -> {staged} (it becomes {final} once published)")
    return final


def check_evaluation(config: FinetuneConfig) -> None:
    """Refuse what :func:`evaluate` would fail on after training: ``evaluate.prompts`` rows of
    neither form, an lm-eval task lm-eval does not know, a gate figure no configured task produces
    (``neuron_parallel.evaluate.check_inputs``)."""
    from neuron_parallel.evaluate import check_inputs

    check_inputs(config.library("evaluate"))


def evaluate(
    config: FinetuneConfig,
    consolidated: str,
    *,
    eval_path: str | None,
    staged: bool = False,
    token: str | None = None,
    log: Log = _quiet,
) -> Evaluation:
    """Evaluate the model at ``consolidated`` (``staged``: the one :func:`consolidate` staged for it,
    which :func:`upload` would publish) on one ``launch.device`` device in the run's precision:
    the eval loss over the eval rows at ``eval_path`` (None: none), the generations of
    ``evaluate.prompts``, ``evaluate.lm_eval_tasks``; then ``evaluate.gate`` against its baseline
    (the base model, or the card published at ``hub.repo_id``, read with ``token``). Writes
    evaluation.json and the generations into ``output.dir`` and reports the figures and
    generations to ``train.report_to``'s trackers (``neuron_parallel.promotion``)."""
    from neuron_parallel.checkpoint.output import claim_run_dir, staged_dir
    from neuron_parallel.config import resolve_precision
    from neuron_parallel.promotion import evaluate_model, generations_markdown, write_evaluation
    from neuron_parallel.reporting import read_metrics, report_evaluation
    from neuron_parallel.run_files import JOB_FILE, METRICS_FILE
    from neuron_parallel.sft import chat_template

    run_dir = claim_run_dir(config.output.dir)
    data = config.library("data")
    train = config.library("train", micro_batch_size=1)  # the micro batch plays no part here
    evaluation = evaluate_model(
        str(staged_dir(consolidated)) if staged else consolidated,
        config.library("evaluate"),
        base_model_dir=model_dir(config),
        device=config.launch.device,
        precision=resolve_precision(config.parallel.mixed_precision, config.launch.device),
        eval_path=eval_path,
        template=lambda tokenizer: chat_template(data, tokenizer),
        objective=train.objective,
        preference=train.preference,
        hub=(config.hub.repo_id, config.hub.endpoint, token) if config.hub.repo_id else None,
        log=log,
    )
    if (run_dir / JOB_FILE).is_file():  # the lineage the training recorded (none for a model evaluated alone)
        evaluation = dataclasses.replace(evaluation, lineage=run_lineage(run_dir) or None)
    write_evaluation(run_dir, evaluation)
    if evaluation.model or evaluation.generations:
        metrics = read_metrics(run_dir / METRICS_FILE) if (run_dir / METRICS_FILE).is_file() else []
        texts = {"evaluate/gate": evaluation.reason}
        if evaluation.generations:
            texts["evaluate/generations"] = generations_markdown(
                evaluation.generations, evaluation.baseline_generations
            )
        step = metrics[-1]["step"] if metrics else 0
        report_evaluation(run_dir, config.train.report_to, step=step, figures=evaluation.model, texts=texts)
    log(f"evaluate: {'promoted' if evaluation.promoted else 'not promoted'}: {evaluation.reason}")
    return evaluation


UPLOAD_RETRIES = 2
"""Further attempts of an upload that failed for a transient reason (``hub.upload_model``)."""
UPLOAD_RETRY_DELAY_S = 5.0


def upload(
    config: FinetuneConfig,
    model_dir: str,
    result: TrainResult,
    layout: CheckedLayout,
    *,
    token: str | None,
    evaluation: Evaluation | None = None,
    log: Log = _quiet,
    warn: Log = _quiet,
) -> HubCommit | None:
    """Write the model card (with ``evaluation``'s figures and generations, :func:`evaluate`'s)
    into the model :func:`consolidate` staged for ``model_dir`` and, when
    ``hub.repo_id`` is set, upload it in one commit (transient failures retried inside, never
    committed twice); then put it in place at ``model_dir``, replacing an earlier run's model
    there only now (``checkpoint/output.py``, ``replace_with_staged``)."""
    from neuron_parallel.checkpoint.output import replace_with_staged, staged_dir
    from neuron_parallel.hub import upload_model

    from .card import write_card

    staged = str(staged_dir(model_dir))
    write_card(config, staged, result, layout, evaluation)
    if not config.hub.repo_id:
        replace_with_staged(model_dir)
        log(f"no hub.repo_id configured: the model stays at {model_dir} and nothing is uploaded")
        return None
    commit = upload_model(
        staged,
        repo_id=config.hub.repo_id,
        endpoint=config.hub.endpoint,
        token=token,
        private=config.hub.private,
        commit_message=f"neuron-flows: {result.final_step} steps",
        retries=UPLOAD_RETRIES,
        retry_delay_s=UPLOAD_RETRY_DELAY_S,
        on_retry=lambda attempt, err: warn(
            f"upload attempt {attempt} failed ({type(err).__name__}: {err}); "
            f"trying again in {UPLOAD_RETRY_DELAY_S:.0f} s"
        ),
    )
    replace_with_staged(model_dir)
    log(f"uploaded to {commit.url} (revision {commit.revision}); the model is at {model_dir}")
    return commit


def run_lineage(run_dir: str | Path) -> dict:
    """What the run in ``run_dir`` trained on (its job's ``lineage``; empty where none is recorded)."""
    from neuron_parallel.config import JobConfig
    from neuron_parallel.run_files import JOB_FILE

    path = Path(run_dir) / JOB_FILE
    return JobConfig.load(path).lineage if path.is_file() else {}


def report(
    result: TrainResult,
    layout: CheckedLayout,
    checkpoint: str,
    model_dir: str,
    commit: HubCommit | None,
    *,
    since_previous: str | None = None,
) -> str:
    """Write the loss curve into the run directory, tag the run's MLflow run (if it reported to
    MLflow) with the consolidated model and Hub URL, and return the run's summary as markdown
    (``since_previous``: what changed in the sources since the previous run, in words)."""
    from neuron_parallel.reporting import loss_curve_png, read_metrics, tag_mlflow_run
    from neuron_parallel.run_files import LOSS_CURVE_FILE, METRICS_FILE

    from .summary import summary_markdown

    metrics = read_metrics(Path(result.run_dir) / METRICS_FILE)
    png = loss_curve_png(metrics)
    (Path(result.run_dir) / LOSS_CURVE_FILE).write_bytes(png)
    tags = {"consolidated_model": str(Path(model_dir).resolve()), **({"hub_url": commit.url} if commit else {})}
    tag_mlflow_run(result.run_dir, tags)
    return summary_markdown(result, layout, checkpoint, model_dir, commit, metrics, png, since_previous)
