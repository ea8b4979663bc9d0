"""Hugging Face causal language models: where a model's files come from (:func:`resolve_model_dir`,
torch-free, for the pipeline's steps) and how the trainer builds, shards and loads one
(``causal_lm``)."""

from __future__ import annotations

from pathlib import Path

from ..utils import names_local_path


def resolve_model_dir(name_or_path: str, revision: str | None = None) -> str:
    """A local directory for the model: the path itself, or a Hub snapshot of the files
    training needs (config, safetensors weights, tokenizer), fetched once into the HF cache."""
    local = Path(name_or_path).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise ValueError(
                f"model.name_or_path {local} has no config.json; point it at a Hugging Face model directory"
            )
        return str(local)
    if names_local_path(name_or_path):
        raise ValueError(
            f"model.name_or_path {name_or_path} does not exist; for a new tiny model run `neuron-flows make-tiny DIR`"
        )
    from huggingface_hub import snapshot_download

    from ..checks import hub_refusal

    patterns = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]
    try:
        return snapshot_download(name_or_path, revision=revision, allow_patterns=patterns)
    except Exception as e:  # not cached and not reachable, an incomplete cached snapshot, refused
        reason = f"its files cannot be fetched ({str(e).splitlines()[0] if str(e) else type(e).__name__})"
        raise hub_refusal("model.name_or_path", name_or_path, "model", revision, reason) from None
