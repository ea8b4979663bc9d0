"""One way out of a checkpoint: :func:`export_checkpoint` writes a Hugging Face model directory, a
peft adapter directory or both, for the ``consolidate`` command and the flow's consolidate step.

The sources come from ``consolidate.py`` (a full checkpoint, ours or optimum-neuron's) and
``adapter.py`` (a LoRA checkpoint's adapter, or the base model with it merged in); ``hf_dir.py``
writes them.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Literal

from .adapter import AdapterSource, MergedSource, base_model_dir, open_adapter_checkpoint, peft_config
from .consolidate import open_source
from .format import Manifest, resolve_checkpoint, user_model_files
from .hf_dir import write_adapter_dir, write_hf_dir
from .neuronx_layout import find_neuronx_checkpoint
from .output import check_output_dir, is_ours

__all__ = ["KINDS", "MERGED_SUBDIR", "Kind", "export_checkpoint", "is_lora_checkpoint"]

Kind = Literal["full", "adapter", "merged", "both"]
KINDS = ("full", "adapter", "merged", "both")
MERGED_SUBDIR = "merged"
"""Where ``kind="both"`` puts the merged model, beside the adapter."""


def export_checkpoint(
    checkpoint: str | Path,
    output: str | Path,
    *,
    kind: Kind | None = None,
    fmt: str = "safetensors",
    max_shard_size: str | int = "5GB",
    model_dir: str | Path | None = None,
    base_dir: str | Path | None = None,
    base_model_name: str | None = None,
    base_model_revision: str | None = None,
) -> Path:
    """Write the checkpoint at ``checkpoint`` to the directory ``output``: ours (a run dir → its
    newest complete checkpoint, a checkpoint dir, or its ``shards/`` folder) or an optimum-neuron
    / neuronx-distributed one (its checkpoint dir or ``shards/``). Refuses a checkpoint that fails
    quick validation or whose files changed since they were written, before anything in
    ``output`` is replaced. ``output`` (and, for ``"both"``, its ``merged/``) must be new, empty
    or an earlier neuron-flows output (``output.py``); anything else is refused before the
    checkpoint is read and before a byte is written.

    ``kind``: ``"full"``, the whole fine-tuned model of a full fine-tuning checkpoint; for a LoRA
    checkpoint ``"adapter"`` (a peft adapter directory), ``"merged"`` (the base model with the
    adapters merged in) or ``"both"`` (the adapter, with the merged model in ``output/merged/``);
    None: ``"full"`` or ``"adapter"``, whichever the checkpoint is. ``fmt`` (``safetensors`` or
    ``pytorch``) and ``max_shard_size``: the weights of a model directory. ``model_dir``: a
    Hugging Face directory whose config, generation config and tokenizer files are copied instead
    of the checkpoint's own. ``base_dir``: the base model to merge into (default: the one the
    manifest records). ``base_model_name`` / ``base_model_revision``: how the adapter's config
    names its base model (default: the base model directory the manifest records)."""
    if kind not in (None, *KINDS):
        raise ValueError(f"kind {kind!r} is not one of {', '.join(KINDS)}")
    check_output_dir(output)
    if kind == "both":
        check_output_dir(Path(output) / MERGED_SUBDIR)
    formats = {"fmt": fmt, "max_shard_size": max_shard_size}
    if model_dir is not None:  # its files are copied: one linking out of the folder is refused before any write
        user_model_files(model_dir)
    if not is_lora_checkpoint(checkpoint):
        return _export_full(checkpoint, output, kind, base_dir, model_dir, formats)
    _refuse_lora_options(checkpoint, kind, base_dir)
    tensors = open_adapter_checkpoint(checkpoint)
    merged = None
    if kind in ("merged", "both"):  # the base model is checked before anything is written
        merged = MergedSource(tensors, base_model_dir(tensors, base_dir), model_dir)
    if kind == "merged":
        out = write_hf_dir(merged, output, **formats)
    else:
        config = peft_config(tensors.manifest, base_model_name, base_model_revision)
        out = write_adapter_dir(AdapterSource(tensors, model_dir), output, config)
        if merged is not None:
            write_hf_dir(merged, out / MERGED_SUBDIR, **formats)
    if kind != "both" and is_ours(out / MERGED_SUBDIR):
        shutil.rmtree(out / MERGED_SUBDIR)  # an earlier export's, of kind both (it carries the marker)
    return out


def _export_full(checkpoint, output, kind: Kind | None, base_dir, model_dir, formats: dict) -> Path:
    """A checkpoint without adapters as a model directory (one that cannot be read is refused
    with its problems by ``open_source``)."""
    source = open_source(checkpoint, model_dir=model_dir)
    if kind not in (None, "full") or base_dir is not None:
        raise ValueError(
            f"{checkpoint} is not a LoRA checkpoint: there are no adapters to export or merge; consolidate it "
            "without --merge (and --base-dir), which writes the whole fine-tuned model"
        )
    return write_hf_dir(source, output, **formats)


def _refuse_lora_options(checkpoint, kind: Kind | None, base_dir) -> None:
    """Refuse, for a LoRA checkpoint, a kind it cannot be exported as and a base model that would
    not be read."""
    if kind == "full":
        raise ValueError(
            f"{checkpoint} is a LoRA checkpoint: it holds adapters, not a whole model; export the adapter, or "
            "the base model with the adapters merged in (--merge)"
        )
    if base_dir is not None and kind not in ("merged", "both"):
        raise ValueError("a base model directory is only read when merging; add --merge (kind='merged')")


def is_lora_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is one of our checkpoints whose manifest records adapters (an unreadable
    one is not, and is refused with its problems by ``open_source``)."""
    if find_neuronx_checkpoint(path) is not None:
        return False
    try:
        return Manifest.load(resolve_checkpoint(path)).adapter is not None
    except (OSError, ValueError, KeyError):
        return False
