"""Publish a fine-tuned model directory to a Hugging Face Hub: model card, then one atomic commit.

Xet and non-Hub endpoints (what huggingface_hub 2.4.0 does, read from its source):

* Whether an upload goes through Xet is decided on the client only. ``utils._runtime.is_xet_available()``
  returns ``not constants.HF_HUB_DISABLE_XET and <hf_xet is importable>``; ``upload_folder`` then takes
  the Xet pipeline and ``create_commit`` uploads through ``_upload_xet_files``, which first asks the
  server for ``/api/{type}s/{repo}/xet-write-token/{rev}``. A server without Xet answers 404 there and
  the upload fails: there is no fallback to LFS.
* Nothing per call changes that: no argument of ``HfApi``/``create_commit``/``upload_folder``, no header,
  and nothing in the server's answers (the preupload response only says "lfs" or "regular"; the LFS
  batch request advertises only "basic"/"multipart"). Older releases let the server decide (repo
  ``xetEnabled``, later the LFS batch ``transfer``); 2.4.0 no longer asks (huggingface_hub#4507, #4786).
* The one documented switch is the ``HF_HUB_DISABLE_XET`` environment variable, read once, when
  ``huggingface_hub.constants`` is imported; setting it later has no effect. ``is_xet_available()``
  however reads the ``constants.HF_HUB_DISABLE_XET`` attribute at every call, so assigning that
  attribute does take effect at run time. ``upload_model`` does exactly that, for the duration of an
  upload to an endpoint other than the public Hub (see ``_xet_off_unless_public_hub``).
* Downloads need nothing: they use Xet only when the server advertises it per file (``X-Xet-Hash``
  header, ``xetHash`` in tree entries), so a server that does not speak Xet gets plain HTTP GETs.

Also found: with Xet on, ``upload_folder`` streams the folder through a pipeline that may split it into
several commits (about 250 files per batch to start with, 100 MiB of non-LFS content, or a batch
open for 5 minutes), so a half-published model could appear on ``main``. ``upload_model`` therefore builds
the operations itself and calls ``create_commit`` once, which is atomic with either transport.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import yaml
from huggingface_hub import CommitOperationAdd, HfApi, ModelCard, ModelCardData, constants
from huggingface_hub.errors import HfHubHTTPError
from huggingface_hub.utils import HFValidationError, validate_repo_id

from .checkpoint.output import OWNER_FILE
from .urls import PUBLIC_HUB

if TYPE_CHECKING:
    from .promotion import Evaluation

__all__ = [
    "HubCommit",
    "base_model_license",
    "card_data_table",
    "published_config",
    "published_name",
    "upload_model",
    "write_model_card",
]

# Endpoints that speak Xet. Any other endpoint (a self-hosted Hub, a test server) gets plain LFS uploads.
_XET_ENDPOINTS = (PUBLIC_HUB, "https://hub-ci.huggingface.co")
# What upload_folder skips by default: git metadata, and the bookkeeping hf_hub_download(local_dir=...) writes.
_SKIPPED_DIRS = (".git",)
_SKIPPED_PREFIXES = (".cache/huggingface/", OWNER_FILE)
_ADAPTER_CONFIG = "adapter_config.json"
_MERGED = "merged"  # where a LoRA run's merged model sits beside its adapter (checkpoint.export.MERGED_SUBDIR)


@dataclass(frozen=True)
class HubCommit:
    """The commit an upload created."""

    repo_id: str
    revision: str
    """The commit oid returned by the server; pass it as ``revision=`` to pin downloads."""
    url: str
    """The commit's URL on the server."""


def write_model_card(
    model_dir: str | Path,
    *,
    repo_id: str | None,
    base_model: str,
    datasets: list[str],
    summary: dict[str, object],
    data: dict[str, object] | None = None,
    config: dict | None = None,
    loss_curve: str | None = None,
    license: str | None = None,
    lineage: dict | None = None,
    evaluation: Evaluation | None = None,
) -> Path:
    """Write ``model_dir/README.md``: Hub metadata (YAML front matter) and a description of the run.
    ``lineage`` (``neuron_parallel.lineage.run_lineage``) adds the Hub commits to the metadata
    (:func:`_revisions`) and a section naming the base model's and each data source's identity (a
    Hub repo's commit, a local one's name and fingerprint), the tokenized data's fingerprint and the
    package versions. ``evaluation`` (the evaluate step's,
    ``neuron_parallel.promotion``) adds its figures to the metadata's ``model-index``
    (``ModelCard.load(...).data.eval_results``) and a section with the figures beside the
    baseline's, the gate's verdict and the sample generations.

    The metadata says ``library_name: transformers`` (``peft`` and the ``lora`` tag for a peft adapter
    directory, one with ``adapter_config.json``), carries the ``neuron-flows`` tag and ``license``
    when given; ``base_model`` and ``datasets`` are listed only when they are Hub repo ids, because
    the Hub rejects cards whose ``base_model`` is not a repo and a local path means nothing to a
    reader. The body names the base model and data, tabulates ``summary`` (e.g. steps, final loss,
    parallel layout, hardware), embeds ``loss_curve`` (an image file in ``model_dir``, linked by its
    relative path so it shows on the Hub next to the card), tabulates ``data`` (e.g.
    :func:`card_data_table`), shows how to load the model from ``repo_id`` (or from
    ``path/to/<model_dir's name>`` when there is no repo id yet): an adapter onto its base model
    with peft, and the merged model of a ``merged/`` folder beside it; and ends with ``config`` as a
    YAML block. The card holds no absolute local path: a local model, dataset or file is named by
    its last component, in ``summary`` and ``config`` too (:func:`published_config`).

    Returns the path of the card. Raises ``ValueError`` if ``model_dir`` is missing or has neither
    ``config.json`` nor ``adapter_config.json``, or if ``loss_curve`` is not a file in it.
    """
    model_dir = _check_model_dir(model_dir)
    if loss_curve is not None and not (model_dir / loss_curve).is_file():
        raise ValueError(f"the loss curve {model_dir / loss_curve} does not exist; write the image there first")
    adapter = _adapter_config(model_dir)
    hub_base = base_model if _is_hub_repo_id(base_model) else None
    hub_datasets = [name for name in datasets if _is_hub_repo_id(name)]
    title = repo_id.split("/")[-1] if repo_id else model_dir.resolve().name
    results = {}
    if evaluation is not None and evaluation.model:
        from .promotion import card_eval_results

        on = ", ".join(published_name(name) for name in datasets) or "the eval rows"
        name, found = card_eval_results(evaluation, model_name=title, dataset=on)
        results = {"model_name": name, "eval_results": found}
    metadata = ModelCardData(
        library_name="peft" if adapter else "transformers",
        pipeline_tag="text-generation",
        tags=["neuron-flows", "fine-tuned", *(["lora"] if adapter else [])],
        base_model=hub_base,
        datasets=hub_datasets or None,
        license=license,
        **results,
        **_revisions(lineage or {}, hub_base, hub_datasets),
    )
    reference = repo_id or f"path/to/{model_dir.resolve().name}"
    summary = published_config(summary)
    lines = _card_intro(title, base_model, datasets, summary, adapter) + _loss_and_data(loss_curve, data or {})
    lines += _evaluation(evaluation) + _lineage(lineage or {})
    lines += _usage(reference, base_model, model_dir, adapter) + _configuration(config)
    card = ModelCard(f"---\n{metadata.to_yaml()}\n---\n\n" + "\n".join(lines))
    path = model_dir / "README.md"
    card.save(path)
    return path


def card_data_table(audit: dict, *, sources: list[str], block_size: int) -> dict[str, object]:
    """The model card's data rows from a tokenize audit (``neuron_parallel.audit``)."""
    rows: dict[str, object] = {
        "sources": ", ".join(_describe(name, "dataset", "datasets/") for name in sources),
        "format": f"{audit.get('format', 'text')} ({audit.get('packing', 'stream')} packing)",
        "examples": f"{audit.get('examples', 0):,} ({audit.get('kept', 0):,} kept, "
        f"{audit.get('truncated', 0):,} truncated, {audit.get('dropped', 0):,} dropped)",
        "tokens": f"{audit.get('tokens', 0):,} ({audit.get('trained_tokens', 0):,} trained on, "
        f"{audit.get('trained_fraction', 0):.1%})",
        "rows": f"{audit.get('rows', 0):,} of {block_size} tokens ({audit.get('fill', 0):.1%} filled)",
    }
    if audit.get("eval_examples"):
        rows["eval"] = f"{audit['eval_examples']:,} examples in {audit.get('eval_rows', 0):,} rows"
    return rows


def base_model_license(model_dir: str | Path) -> str | None:
    """The ``license`` in the metadata of the base model's card (``model_dir/README.md``), which a
    fine-tuned model inherits; None when there is no card or it names none."""
    path = Path(model_dir) / "README.md"
    if not path.is_file():
        return None
    return ModelCard.load(path).data.license


def upload_model(
    model_dir: str | Path,
    *,
    repo_id: str,
    endpoint: str | None = None,
    token: str | None = None,
    private: bool = False,
    commit_message: str = "Upload fine-tuned model",
    retries: int = 0,
    retry_delay_s: float = 5.0,
    on_retry: Callable[[int, Exception], None] | None = None,
) -> HubCommit:
    """Create ``repo_id`` if needed and upload every file of ``model_dir`` to its ``main`` in one commit.

    ``endpoint`` defaults to ``HF_ENDPOINT`` (the public Hub); ``token`` to the locally saved login.
    ``private`` applies only when the repo is created; an existing repo keeps its visibility.
    ``model_dir`` may be a peft adapter directory, with the merged model in a ``merged/`` folder.
    Files under ``.git/`` and ``.cache/huggingface/`` are skipped, as ``upload_folder`` does;
    files unchanged on the server are left out of the commit by huggingface_hub, and when no file
    changed no commit is made: the returned ``HubCommit`` is then the branch's current head.

    A failure that another attempt may not meet (a dropped or refused connection, a timeout, an
    HTTP 5xx, 408 or 429) is retried up to ``retries`` times, ``retry_delay_s`` apart, calling
    ``on_retry(attempt, error)`` before each. Retrying is safe: LFS files already on the server are
    not sent again, and a commit the server made but whose answer was lost is not made twice,
    because the retry finds every file already there.

    For an endpoint other than the public Hub, Xet is switched off for the duration of the call and
    large files go through git-LFS, which every Hub-compatible server implements; huggingface_hub offers
    no per-call option for this (see the module docstring). While such an upload runs, Xet is off for
    the whole process, so a concurrent public-Hub transfer in another thread uses plain HTTP/LFS too
    (slower, still correct). Setting ``HF_HUB_DISABLE_XET=1`` before huggingface_hub is imported is
    the library's documented, process-wide alternative.

    Raises ``ValueError`` (before any network call) if ``model_dir`` is missing or has neither
    ``config.json`` nor ``adapter_config.json``, and ``huggingface_hub.errors.HfHubHTTPError`` (or a
    subclass) on HTTP errors, e.g. 401 without a valid token.
    """
    model_dir = _check_model_dir(model_dir)
    files = list(_model_files(model_dir))
    api = HfApi(endpoint=endpoint, token=token)
    for attempt in range(1, retries + 2):
        # New operations each attempt: huggingface_hub keeps what the server said about a file in its
        # operation, and reusing one would skip the fresh check that keeps a retry from committing twice.
        operations = [CommitOperationAdd(path_in_repo=path, path_or_fileobj=local) for path, local in files]
        try:
            with _xet_off_unless_public_hub(api.endpoint):
                repo_url = api.create_repo(repo_id, exist_ok=True, private=private)
                info = api.create_commit(repo_url.repo_id, operations=operations, commit_message=commit_message)
            return HubCommit(repo_id=repo_url.repo_id, revision=info.oid, url=info.commit_url)
        except Exception as err:
            if attempt > retries or not _transient(err):
                raise
            if on_retry is not None:
                on_retry(attempt, err)
            time.sleep(retry_delay_s)
    raise AssertionError("unreachable: the last attempt returns or raises")


def _transient(err: Exception) -> bool:
    """Whether another attempt may succeed: not for a refusal such as a bad token (401), missing
    rights (403) or an invalid request, nor for a local ``ValueError``/``OSError`` about the files."""
    if isinstance(err, HfHubHTTPError):
        status = err.response.status_code if err.response is not None else 0
        return status >= 500 or status in (408, 429)
    if isinstance(err, ConnectionError | TimeoutError):
        return True
    # httpx's transport errors (of whichever httpx huggingface_hub uses) are not OSErrors.
    return not isinstance(err, ValueError | OSError)


def _check_model_dir(model_dir: str | Path) -> Path:
    path = Path(model_dir)
    if not path.is_dir():
        raise ValueError(f"model directory {path} does not exist (or is not a directory)")
    if not (path / "config.json").is_file() and not (path / _ADAPTER_CONFIG).is_file():
        raise ValueError(
            f"model directory {path} has no config.json (nor a peft {_ADAPTER_CONFIG}); save the model with "
            "save_pretrained or consolidate the checkpoint first"
        )
    return path


def _adapter_config(model_dir: Path) -> dict | None:
    """The peft ``adapter_config.json`` of an adapter directory, else None."""
    path = model_dir / _ADAPTER_CONFIG
    return json.loads(path.read_text()) if path.is_file() else None


def _is_hub_repo_id(name: str) -> bool:
    """True for ``name`` / ``org/name`` that is not also an existing local path."""
    if Path(name).expanduser().exists():
        return False
    try:
        validate_repo_id(name)  # rejects absolute paths, './x', 'a/b/c', ...
    except HFValidationError:
        return False
    return True


def _model_files(model_dir: Path) -> Iterator[tuple[str, Path]]:
    """(path in repo, local path) for every file to upload, sorted for a reproducible commit."""
    for dirpath, dirnames, filenames in os.walk(model_dir):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIPPED_DIRS)
        for filename in sorted(filenames):
            local = Path(dirpath) / filename
            path_in_repo = local.relative_to(model_dir).as_posix()
            if not path_in_repo.startswith(_SKIPPED_PREFIXES):
                yield path_in_repo, local


def published_name(name: str) -> str:
    """How a published file names a model, a dataset or a file: a Hub repo id as it is, a local
    path by its last component only (the rest is this machine's layout, and may say who runs it)."""
    return name if _is_hub_repo_id(name) else Path(os.path.abspath(Path(name).expanduser())).name


def _is_local_path(value: str) -> bool:
    """Whether ``value`` is an absolute path (``~`` included) or one that exists here."""
    try:
        path = Path(value).expanduser()
        return path.is_absolute() or path.exists()
    except (OSError, ValueError):  # a name too long for the filesystem, a NUL byte: not a path
        return False


def published_config(value: object) -> object:
    """``value`` (a run's configuration or summary: mappings, lists, strings, numbers) as a
    published file may hold it: every string that is an absolute local path, or a path that
    exists here, becomes its last component (:func:`published_name`); the rest is kept."""
    if isinstance(value, dict):
        return {k: published_config(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [published_config(v) for v in value]
    if isinstance(value, str) and _is_local_path(value):
        return published_name(value)
    return value


def _describe(name: str, kind: str, url_prefix: str) -> str:
    """A Hub id as a link; of a local path only the last component (the rest is this machine's layout)."""
    if _is_hub_repo_id(name):
        return f"[{name}]({PUBLIC_HUB}/{url_prefix}{name})"
    return f"a local {kind} (`{published_name(name)}`)"


def _md_table(rows: dict[str, object]) -> list[str]:
    return ["| Item | Value |", "| --- | --- |", *(f"| {_md_cell(k)} | {_md_cell(v)} |" for k, v in rows.items())]


def _loss_and_data(loss_curve: str | None, data: dict[str, object]) -> list[str]:
    lines: list[str] = []
    if loss_curve:
        lines += ["## Loss curve", "", f"![loss curve]({Path(loss_curve).as_posix()})", ""]
    if data:
        lines += ["## Data", "", *_md_table(data), ""]
    return lines


def _configuration(config: dict | None) -> list[str]:
    if not config:
        return []
    dumped = yaml.safe_dump(published_config(config), sort_keys=False, allow_unicode=True).strip()
    return [
        "## Configuration",
        "",
        "The run's configuration (`neuron-flows run` takes it):",
        "",
        "```yaml",
        dumped,
        "```",
        "",
    ]


def _md_cell(value: object) -> str:
    text = f"{value:.4g}" if isinstance(value, float) else str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def _card_intro(
    title: str, base_model: str, datasets: list[str], summary: dict[str, object], adapter: dict | None
) -> list[str]:
    data = ", ".join(_describe(name, "dataset", "datasets/") for name in datasets)
    base = _describe(base_model, "checkpoint", "")
    if adapter:
        targets = ", ".join(adapter.get("target_modules") or [])
        what = f"A LoRA adapter (r={adapter['r']}, alpha={adapter['lora_alpha']}, on {targets}) for {base},"
        lines = [f"# {title}", "", f"{what} trained with neuron-flows"]
    else:
        lines = [f"# {title}", "", f"A causal language model fine-tuned from {base} with neuron-flows"]
    lines += [f"on {data}." if datasets else "(training data not recorded).", ""]
    if summary:
        lines += ["## Training summary", "", *_md_table(summary), ""]
    return lines


def _evaluation(evaluation: Evaluation | None) -> list[str]:
    """The evaluate step's figures (beside the baseline's), the gate's verdict, the generations."""
    if evaluation is None or not (evaluation.model or evaluation.generations):
        return []
    from .promotion import prompt_text

    lines = ["## Evaluation", ""]
    base = {"base": "base model", "hub": "published model"}.get(evaluation.baseline_kind or "")
    if evaluation.model:
        lines += [f"| Metric | This model |{f' {base} |' if base else ''}", f"| --- | --- |{' --- |' if base else ''}"]
        for key, value in evaluation.model.items():
            other = evaluation.baseline.get(key)
            shown = f" {_md_cell(other) if other is not None else '-'} |" if base else ""
            lines.append(f"| {_md_cell(key)} | {_md_cell(value)} |{shown}")
        lines.append("")
    if base:
        lines += [f"Gate ({'promoted' if evaluation.promoted else 'not promoted'}): {_md_cell(evaluation.reason)}", ""]
    if evaluation.generations:
        lines += ["### Sample generations", "", "Greedy decoding of each prompt.", ""]
        lines += ["| Prompt | Completion |", "| --- | --- |"]
        lines += [
            f"| {_md_cell(prompt_text(g['prompt']))} | {_md_cell(g['completion'])} |" for g in evaluation.generations
        ]
        lines.append("")
    return lines


def _revisions(lineage: dict, hub_base: str | None, hub_datasets: list[str]) -> dict[str, object]:
    """The commits the run trained on, as metadata beside ``base_model`` and ``datasets``:
    ``base_model_revision`` (the Hub's metadata has no revision field of its own; a reader of the
    card's YAML gets the exact snapshot with ``from_pretrained(base_model, revision=...)``) and
    ``dataset_revisions`` (Hub repo id → commit), from the run's ``lineage``; Hub sources only."""
    out: dict[str, object] = {}
    model = lineage.get("model")
    if hub_base and isinstance(model, dict) and model.get("repo") == hub_base and model.get("commit"):
        out["base_model_revision"] = model["commit"]
    commits = {
        entry["repo"]: entry["commit"]
        for entry in (lineage.get("data") or {}).values()
        if isinstance(entry, dict) and entry.get("repo") in hub_datasets and entry.get("commit")
    }
    if commits:
        out["dataset_revisions"] = commits
    return out


def _lineage(lineage: dict) -> list[str]:
    """What the model was trained from, by identity: no local path, only names and digests."""
    from .lineage import describe_identity, identity

    if not lineage:
        return []
    rows = {"base model": describe_identity(identity(lineage.get("model")))}
    for name, entry in (lineage.get("data") or {}).items():
        if isinstance(entry, dict):
            rows[entry.get("key", name)] = describe_identity(identity(entry))
    rows["tokenized data"] = f"fingerprint {(lineage.get('data') or {}).get('fingerprint')}"
    rows["versions"] = ", ".join(f"{k} {v}" for k, v in (lineage.get("versions") or {}).items())
    return ["## Lineage", "", *_md_table(rows), ""]


def _usage(reference: str, base_model: str, model_dir: Path, adapter: dict | None) -> list[str]:
    has_tokenizer = any((model_dir / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json"))
    quoted = json.dumps(reference)  # a valid Python string literal, whatever the path contains
    lines = ["## Usage", "", "```python"]
    lines.append("from transformers import AutoModelForCausalLM" + (", AutoTokenizer" if has_tokenizer else ""))
    if adapter:
        if _is_hub_repo_id(base_model):
            base_line = f"base = AutoModelForCausalLM.from_pretrained({json.dumps(base_model)})"
        else:
            base_path = json.dumps(f"path/to/{published_name(base_model)}")
            base_line = f"base = AutoModelForCausalLM.from_pretrained({base_path})  # the local base model"
        lines += ["from peft import PeftModel", "", base_line]
        lines.append(f"model = PeftModel.from_pretrained(base, {quoted})")
    else:
        lines += ["", f"model = AutoModelForCausalLM.from_pretrained({quoted})"]
    if has_tokenizer:
        lines.append(f"tokenizer = AutoTokenizer.from_pretrained({quoted})")
    if adapter and (model_dir / _MERGED / "config.json").is_file():
        # transformers' Auto classes look for an adapter config at the repo's root unless told the subfolder.
        sub = json.dumps(_MERGED)
        lines.append("# the base model with the adapter merged in, a plain transformers model:")
        lines += [
            "merged = AutoModelForCausalLM.from_pretrained(",
            f'    {quoted}, subfolder={sub}, adapter_kwargs={{"subfolder": {sub}}}',
            ")",
        ]
    lines += ["```", ""]
    return lines


# A refcount rather than a plain lock, so that overlapping uploads to non-Xet endpoints run concurrently
# and the original value comes back only when the last of them ends.
_xet_lock = threading.Lock()
_xet_holders = 0
_xet_saved = False


@contextmanager
def _xet_off_unless_public_hub(endpoint: str) -> Iterator[None]:
    """Set ``constants.HF_HUB_DISABLE_XET`` for the duration of the block unless ``endpoint`` speaks Xet."""
    global _xet_holders, _xet_saved
    if endpoint.rstrip("/") in _XET_ENDPOINTS:
        yield
        return
    with _xet_lock:
        if _xet_holders == 0:
            _xet_saved = constants.HF_HUB_DISABLE_XET
            constants.HF_HUB_DISABLE_XET = True
        _xet_holders += 1
    try:
        yield
    finally:
        with _xet_lock:
            _xet_holders -= 1
            if _xet_holders == 0:
                constants.HF_HUB_DISABLE_XET = _xet_saved
