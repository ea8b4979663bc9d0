"""What a run trained on, by identity rather than by name: the record that every checkpoint's
``trainer_state.json``, the MLflow run's params and the model card carry (``lineage``).

- ``model``: a Hub model's ``repo`` and ``commit``, or a local model's folder ``path`` (its name,
  never the whole path) and ``fingerprint`` (the digest of its weights,
  ``checkpoint.format.base_model_identity``);
- ``data``: each source's identity as the tokenize step recorded it (``data.data_lineage``) and
  the rows' ``fingerprint``;
- ``versions``: the packages that decide the numbers (torch, transformers, datasets,
  huggingface_hub, neuron-flows).

A run resumes only from checkpoints of the same model and data (:func:`check_same_sources`).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
from pathlib import Path

from .utils import names_local_path

PACKAGES = ("torch", "transformers", "datasets", "huggingface_hub", "neuron-flows")
"""The packages whose versions a run records."""
IDENTITY_KEYS = ("repo", "commit", "path", "fingerprint")
"""What identifies a model or a source; other fields (the config key, whether the cache served
it) describe how it was read."""


class SourcesChanged(ValueError):
    """A run's checkpoints were trained on another model or other data than it is given now."""


def package_versions() -> dict[str, str]:
    """The installed version of each of :data:`PACKAGES` (``missing`` when it is not installed)."""
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "missing"
    return versions


def model_identity(name_or_path: str, model_path: str | Path) -> dict:
    """The identity of the model named ``name_or_path`` whose files are in ``model_path``: a Hub
    model's repo id and the commit of its snapshot, a local one's folder name and weights digest."""
    from .checkpoint.format import base_model_identity

    local = Path(name_or_path).expanduser()
    if not local.exists() and not names_local_path(name_or_path) and Path(model_path).parent.name == "snapshots":
        return {"repo": name_or_path, "commit": Path(model_path).name}  # a Hub snapshot's folder is its commit
    return {"path": local.resolve().name, "fingerprint": base_model_identity(model_path)["sha256"][:20]}


def run_lineage(model: dict, data: dict) -> dict:
    """The run's record: ``model`` (:func:`model_identity`), ``data`` (``data.data_lineage``) and
    the package versions."""
    return {"model": model, "data": data, "versions": package_versions()}


def identity(entry: object) -> object:
    """The fields of a model's or a source's record that identify it (:data:`IDENTITY_KEYS`)."""
    return {k: entry.get(k) for k in IDENTITY_KEYS if k in entry} if isinstance(entry, dict) else entry


def describe_identity(entry: object) -> str:
    """A model's or a source's identity in words: ``org/name at commit …``, ``name (fingerprint …)``."""
    if not isinstance(entry, dict):
        return "nothing" if entry is None else str(entry)
    if "repo" in entry:
        cached = f", from the local cache ({entry['cached']})" if entry.get("cached") else ""
        return f"{entry['repo']} at commit {entry.get('commit')}{cached}"
    return f"{entry.get('path')} (fingerprint {entry.get('fingerprint')})"


def source_changes(saved: dict, current: dict) -> list[str]:
    """What differs between two run records (:func:`run_lineage`) in the model or a data source:
    one line each, e.g. ``data.source: wikitext at commit a… → wikitext at commit b…``."""
    pairs = [("model.name_or_path", saved.get("model"), current.get("model"))]
    saved_data, current_data = saved.get("data") or {}, current.get("data") or {}
    for name in sorted((set(saved_data) | set(current_data)) - {"fingerprint"}):
        old, new = saved_data.get(name), current_data.get(name)
        either = old if isinstance(old, dict) else new if isinstance(new, dict) else {}
        pairs.append((either.get("key", f"data.{name}"), old, new))
    return [
        f"{key}: {describe_identity(identity(old))} → {describe_identity(identity(new))}"
        for key, old, new in pairs
        if identity(old) != identity(new)
    ]


def sources_key(lineage: dict) -> str:
    """What makes two runs the same fine-tune when their revisions are compared: the model and
    each data source by name (a Hub repo id, a local folder's or file's name), without commits or
    fingerprints, as a short digest (lowercase hex, usable in a Prefect artifact key)."""

    def name(entry: object) -> object:
        return (entry.get("repo") or entry.get("path")) if isinstance(entry, dict) else entry

    data = lineage.get("data") or {}
    names = {"model": name(lineage.get("model")), **{k: name(v) for k, v in data.items() if k != "fingerprint"}}
    return hashlib.sha256(json.dumps(names, sort_keys=True).encode()).hexdigest()[:16]


def identity_rows(lineage: dict) -> list[dict]:
    """A run record's identities as table rows (``entry``, the config ``key``, ``identity`` in
    words and the identifying fields), readable back with :func:`from_identity_rows`."""
    entries = [("model", {"key": "model.name_or_path", **(lineage.get("model") or {})})]
    entries += [(k, v) for k, v in (lineage.get("data") or {}).items() if k != "fingerprint" and isinstance(v, dict)]
    return [
        {"entry": name, "key": entry.get("key", f"data.{name}"), "identity": describe_identity(identity(entry))}
        | identity(entry)
        for name, entry in entries
    ]


def from_identity_rows(rows: list[dict]) -> dict:
    """The model and data identities of :func:`identity_rows`' rows, as a run record
    (:func:`source_changes` compares two)."""
    record: dict = {"model": None, "data": {}}
    for row in rows:
        fields = {k: row[k] for k in IDENTITY_KEYS if k in row}
        if row.get("entry") == "model":
            record["model"] = fields
        else:
            record["data"][row.get("entry")] = {"key": row.get("key"), **fields}
    return record


def check_same_sources(saved: dict | None, current: dict, checkpoint: str | Path) -> None:
    """Refuse (:class:`SourcesChanged`) to continue ``checkpoint``, recorded as trained on
    ``saved`` (its trainer state's ``lineage``), with ``current``'s model or data. A checkpoint
    that records none, or a run that has none, is not checked."""
    if not saved or not current:
        return
    changes = source_changes(saved, current)
    if changes:
        raise SourcesChanged(
            f"{checkpoint} was trained on another model or other data than this run is given "
            f"({'; '.join(changes)}); to resume, pin model.revision / data.revision to the commits the checkpoint "
            "records (its trainer_state.json, lineage) or restore that data, or start a new run in another output.dir"
        )


def check_resume(run_dir: str | Path, current: dict) -> None:
    """Refuse (:class:`SourcesChanged`) a run whose ``run_dir`` holds a complete checkpoint trained
    on another model or other data than ``current`` records: the check the ranks make when they
    resume (``train._resume``), made before they start. A trainer state that cannot be read is left
    to the ranks, which skip such a checkpoint."""
    from .checkpoint.format import TRAINER_STATE, is_complete, list_checkpoints
    from .utils import read_json

    complete = [c for c in list_checkpoints(run_dir) if is_complete(c)]
    if not complete:
        return
    try:
        state = read_json(complete[-1] / TRAINER_STATE)
    except (OSError, ValueError):
        return
    check_same_sources(state.get("lineage") if isinstance(state, dict) else None, current, complete[-1])
