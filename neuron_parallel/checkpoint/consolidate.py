"""A full checkpoint, sharded in any layout, as the tensors of one Hugging Face model: the
sources that ``hf_dir.py`` streams into a model directory.

Our own checkpoints (:class:`ManifestSource`: manifest and safetensors pieces) are exported in
one pass over each piece file (``scatter.py``): read once, hashed as read, each piece's bytes
sent straight to its place in the output, with memory at a few read buffers. optimum-neuron /
neuronx-distributed checkpoints (``neuronx.py``) are read tensor by tensor. :func:`open_source`
opens either, after validation.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .dtypes import dtype_from_name
from .format import HF_FILES, model_files, resolve_checkpoint
from .neuronx import NeuronxCheckpoint
from .neuronx_layout import find_neuronx_checkpoint
from .scatter import Target, scatter_pieces
from .shapes import MODULE_WEIGHTS
from .tensors import CheckpointTensors
from .validate import check_digest, validate_checkpoint, verify_checksums


def _export_plan(tensors: CheckpointTensors) -> list[tuple[str, list[int], torch.dtype]]:
    """(name, exported shape, dtype) of every model tensor, in manifest order; drops the tied
    lm_head and strips rows a vocab-padded embedding added beyond the config's vocab_size."""
    config = tensors.manifest.model_config
    vocab = config.get("vocab_size")
    plan = []
    for name in tensors.names("model"):
        entry = tensors.manifest.tensors[name]
        if name == MODULE_WEIGHTS["lm_head"] and config.get("tie_word_embeddings"):
            continue
        shape = list(entry.shape)
        if name in MODULE_WEIGHTS.values() and vocab and shape[0] > vocab:
            shape[0] = vocab
        plan.append((name, shape, dtype_from_name(entry.dtype)))
    return plan


class ManifestSource:
    """One of our checkpoints (manifest + safetensors pieces) as a tensor source for ``hf_dir.py``;
    ``model_dir``: a Hugging Face directory whose config and tokenizer files replace its own."""

    def __init__(self, ckpt: Path, model_dir: str | Path | None = None) -> None:
        self.root = ckpt
        self.tensors = CheckpointTensors(ckpt)
        self.model_config = self.tensors.manifest.model_config
        self._plan = _export_plan(self.tensors)
        self._shapes = {name: shape for name, shape, _ in self._plan}
        self._itemsizes = {name: dtype.itemsize for name, _, dtype in self._plan}
        self._model_dir = None if model_dir is None or Path(model_dir) == ckpt else Path(model_dir)

    def plan(self) -> list[tuple[str, list[int], torch.dtype]]:
        return self._plan

    def read(self, name: str) -> torch.Tensor:
        shape = self._shapes[name]
        return self.tensors.read(name, [0] * len(shape), shape)

    def byte_ranges(self, name: str) -> list[tuple[Path, int, int]] | None:
        """File ranges holding the exported tensor's bytes in order, when its pieces are whole rows."""
        shape = self._shapes[name]
        return self.tensors.byte_ranges(name, shape[0]) if shape else None

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` (along dim 0) of the exported tensor."""
        shape = self._shapes[name]
        return self.tensors.read(name, [start] + [0] * (len(shape) - 1), [stop - start, *shape[1:]])

    def hf_files(self) -> list[Path]:
        return model_files(self.root, self._model_dir)

    def read_files(self) -> list[str]:
        """The manifest's files that exporting reads: those holding pieces of the exported
        tensors, and the config and tokenizer files copied from the checkpoint."""
        pieces = {p.file for name in self._shapes for p in self.tensors.pieces(name)}
        copied = {p.name for p in self.hf_files()} if self._model_dir is None else set()
        return sorted(pieces | (copied & set(self.tensors.manifest.files)))

    def verify(self) -> None:
        """Refuse the checkpoint unless every file exporting reads has its recorded sha256 (for
        writers that read tensor by tensor; :meth:`scatter` hashes as it copies)."""
        verify_checksums(self.root, self.tensors.manifest, self.read_files())

    def scatter(self, places: dict[str, tuple[int, int]]) -> None:
        """Write every planned tensor to its place (an output file descriptor and the offset of
        the tensor's first byte in it) in one pass over each piece file (see ``scatter.py``),
        then refuse the checkpoint if a file read does not have its recorded sha256: the caller
        keeps the output files out of place until this returns."""
        targets = {
            name: Target(fd, offset, tuple(self._shapes[name]), self._itemsizes[name])
            for name, (fd, offset) in places.items()
        }
        digests = scatter_pieces(self.tensors, targets)
        for rel, digest in sorted(digests.items()):
            check_digest(self.root, self.tensors.file_path(rel), digest, self.tensors.manifest.files[rel]["sha256"])


def open_source(path: str | Path, *, model_dir: str | Path | None = None) -> ManifestSource | NeuronxCheckpoint:
    """The checkpoint at ``path`` as a tensor source, after quick validation: ours (a run
    dir, checkpoint dir or its ``shards/``) or an optimum-neuron / neuronx-distributed one (its
    checkpoint dir or ``shards/``; see ``neuronx.py``). Refuses an incomplete or damaged one, and
    one of ours whose config or tokenizer files do not have the sha256 its manifest records (its
    piece files are hashed as the export reads them: :meth:`ManifestSource.scatter`)."""
    shards = find_neuronx_checkpoint(path)
    if shards is not None:
        return NeuronxCheckpoint(shards, model_dir=model_dir)
    ckpt = resolve_checkpoint(path)
    # Structure only: files, sizes, coverage. The model-shape check imports transformers and
    # builds the model on meta, seconds and ~70 MB that streaming itself does not need.
    problems = validate_checkpoint(ckpt, quick=True, check_model=False)
    if problems:
        raise ValueError(f"refusing to consolidate {ckpt}: " + "; ".join(problems))
    source = ManifestSource(ckpt, model_dir)
    source.tensors.check_pieces()
    # The config and tokenizer files now; the piece files are hashed as the export reads them.
    verify_checksums(ckpt, source.tensors.manifest, [f for f in source.read_files() if f in {*HF_FILES}])
    return source
