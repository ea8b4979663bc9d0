"""Reading tokenized rows back as training and eval batches.

A tokenized dataset (``neuron_parallel.data.tokenize_data``) holds rows of ``block_size``
tokens: ``input_ids``, ``labels`` (the target of each input position, ``IGNORE_INDEX`` where no
loss is taken) and, for datasets packed by document, ``position_ids`` that restart at 0 where
each document begins. A row without ``position_ids`` is one causal stream.

Rows are read as numpy arrays and handed over as tensors; what the trainer needs to know about
them on the host (which rows a step reads, how many labelled positions they hold) is numpy and
plain Python, so a training step never reads a value back from a tensor for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

IGNORE_INDEX = -100
"""The label of a position that takes no loss (a prompt token, padding, a document's end)."""


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor of a batch on ``device`` without waiting for it. On CUDA a copy from pageable
    memory makes the host wait until the stream has drained (a host sync every step), so the rows
    go through pinned memory and are copied asynchronously (the caching host allocator keeps the
    pinned buffer until the copy has run). Elsewhere a plain ``to``: on CPU nothing is copied;
    TorchNeuron queues the transfer in its own runtime."""
    if device.type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


@dataclass(frozen=True, slots=True)
class Batch:
    """Rows of token ids, their targets, and (document-packed data) their positions, each
    ``(rows, block_size)``."""

    inputs: torch.Tensor
    labels: torch.Tensor
    positions: torch.Tensor | None = None
    targets: int | None = None
    """Positions that take a loss, counted on the host when the rows were read (None: not counted)."""
    causal_rows: tuple[bool, ...] | None = None
    """Per row of document-packed data, :func:`causal_rows` as found on the host when the rows
    were read (None: not known, so each row attends within its documents)."""
    sequence_ids: torch.Tensor | None = None
    """Preference rows: which completion each labelled position belongs to
    (:mod:`neuron_parallel.pairs`)."""
    reference: torch.Tensor | None = None
    """Preference rows: the reference's summed log-probability of each completion, by sequence id
    (``(rows, slots)``), where the reference step computed them."""
    documents: torch.Tensor | None = None
    """Under context parallelism, rows cut to one cp rank's positions: the document number of
    every position of the whole rows ``(rows, block_size)``, found before they were cut
    (:func:`neuron_parallel.parallel.context.shard_batch`)."""

    @property
    def causal(self) -> bool:
        """Whether plain causal attention over whole rows, with no mask, trains these rows
        exactly: a stream, or document rows that are all :func:`causal_rows`."""
        return self.positions is None or (self.causal_rows is not None and all(self.causal_rows))

    @property
    def num_targets(self) -> int:
        """Positions that take a loss: :attr:`targets`, or else counted from ``labels``."""
        if self.targets is not None:
            return self.targets
        return int((self.labels != IGNORE_INDEX).sum())

    def split(self, count: int) -> list[Batch]:
        """Consecutive batches of ``count`` rows."""
        tensors = (self.inputs, self.labels, self.positions, self.sequence_ids, self.reference, self.documents)
        parts = [t.split(count) if t is not None else None for t in tensors]
        n = len(parts[0])
        rows = self.causal_rows
        return [
            Batch(
                parts[0][i],
                parts[1][i],
                parts[2][i] if parts[2] is not None else None,
                causal_rows=rows[i * count : (i + 1) * count] if rows is not None else None,
                sequence_ids=parts[3][i] if parts[3] is not None else None,
                reference=parts[4][i] if parts[4] is not None else None,
                documents=parts[5][i] if parts[5] is not None else None,
            )
            for i in range(n)
        ]


def causal_rows(positions: np.ndarray, labels: np.ndarray) -> tuple[bool, ...]:
    """Per row of ``positions`` and ``labels`` (rows, block_size), whether every labelled position
    lies in the row's first document (before the first position id 0 after the start). Causal
    attention over the whole row, with no mask, then gives every labelled position exactly what
    attention within its document gives it: the first document starts the row, and what follows
    it (padding, or documents without a label) is never seen by an earlier position; its outputs
    take no loss, so they add nothing to the loss or to any gradient."""
    positions, labels = np.asarray(positions), np.asarray(labels)
    seq = positions.shape[1]
    restart = positions[:, 1:] == 0
    first_end = np.where(restart.any(axis=1), restart.argmax(axis=1) + 1, seq)
    labelled = labels != IGNORE_INDEX
    last_label = np.where(labelled.any(axis=1), seq - 1 - labelled[:, ::-1].argmax(axis=1), -1)
    return tuple(bool(x) for x in last_label < first_end)


def _load(path: str | Path):
    from datasets import load_from_disk

    return load_from_disk(str(path)).with_format("numpy")


def _targets_per_row(labels: np.ndarray) -> np.ndarray:
    """Labelled positions of each row of ``labels`` (rows, block_size)."""
    return np.count_nonzero(np.asarray(labels) != IGNORE_INDEX, axis=1)


def _batch(dataset, indices: list[int], pad_to: int = 0, reference=None) -> Batch:
    """Rows ``indices`` of ``dataset`` (numpy format) as a :class:`Batch`, followed by empty rows
    up to ``pad_to`` rows (token 0, no targets, positions ``0..block_size-1``), so that the batch
    shape stays fixed where the data runs out; ``reference``: the rows' reference log-probabilities
    (preference data, :mod:`neuron_parallel.preference`), read at the same indices."""
    rows = dataset[indices] if indices else None
    columns = ("input_ids", "labels", "position_ids", "sequence_ids")
    out = {
        c: np.asarray(rows[c], dtype=np.int64) if rows is not None else None
        for c in columns
        if c in dataset.column_names
    }
    has_positions = "position_ids" in out
    missing = pad_to - len(indices)
    if missing > 0:
        block = len(dataset[0]["input_ids"])
        empty = {
            "input_ids": np.zeros((missing, block), dtype=np.int64),
            "labels": np.full((missing, block), IGNORE_INDEX, dtype=np.int64),
            "position_ids": np.broadcast_to(np.arange(block, dtype=np.int64), (missing, block)),
            "sequence_ids": np.full((missing, block), -1, dtype=np.int64),
        }
        for c in out:
            out[c] = empty[c] if out[c] is None else np.concatenate([out[c], empty[c]])
    tensors = {c: torch.from_numpy(np.ascontiguousarray(a)) for c, a in out.items()}
    targets = int(_targets_per_row(out["labels"]).sum())
    causal = causal_rows(out["position_ids"], out["labels"]) if has_positions else None
    ref = None
    if reference is not None:
        from .preference import REFERENCE_COLUMN

        values = np.asarray(reference[indices][REFERENCE_COLUMN], dtype=np.float32) if indices else None
        width = len(reference[0][REFERENCE_COLUMN])
        if missing > 0:
            empty = np.zeros((missing, width), dtype=np.float32)
            values = empty if values is None else np.concatenate([values, empty])
        ref = torch.from_numpy(np.ascontiguousarray(values))
    return Batch(
        tensors["input_ids"],
        tensors["labels"],
        tensors.get("position_ids"),
        targets,
        causal,
        sequence_ids=tensors.get("sequence_ids"),
        reference=ref,
    )


class BlockStream:
    """The order training reads packed rows in: a seeded permutation per epoch, consumed
    sequentially, so optimizer step ``s`` always sees global samples ``[s·G, (s+1)·G)``
    whatever the parallel layout and wherever a resumed run starts."""

    def __init__(self, path: str | Path, *, seed: int, reference: str | Path | None = None) -> None:
        self.dataset = _load(path)
        self.reference = _load(reference) if reference is not None else None
        self._pairs = None
        self.num_blocks = len(self.dataset)
        self.seed = seed
        self._perm: tuple[int, np.ndarray] | None = None
        self._labels = self.dataset.select_columns(["labels"])
        self._targets = np.full(self.num_blocks, -1, dtype=np.int64)
        """Labelled positions of each row, -1 until the row is first counted."""

    def _permutation(self, epoch: int) -> np.ndarray:
        if self._perm is None or self._perm[0] != epoch:
            rng = np.random.default_rng((self.seed * 1_000_003 + epoch) % 2**64)
            self._perm = (epoch, rng.permutation(self.num_blocks))
        return self._perm[1]

    def indices(self, start: int, count: int) -> list[int]:
        """Dataset rows for global sample positions ``start .. start + count - 1``."""
        out = []
        for g in range(start, start + count):
            epoch, pos = divmod(g, self.num_blocks)
            out.append(int(self._permutation(epoch)[pos]))
        return out

    def batch(self, start: int, count: int) -> Batch:
        """The rows at global sample positions ``start .. start + count - 1``."""
        return _batch(self.dataset, self.indices(start, count), reference=self.reference)

    def num_pairs(self, start: int, count: int) -> int:
        """Preference pairs in the rows at global sample positions ``start .. start + count - 1``,
        counted on the host from the rows' sequence ids (all rows counted once, at first use)."""
        if self._pairs is None:
            self._pairs = _pairs_of(self.dataset)
        return int(self._pairs[np.asarray(self.indices(start, count), dtype=np.int64)].sum())

    def num_targets(self, start: int, count: int) -> int:
        """Labelled positions in the rows at global sample positions ``start .. start + count - 1``,
        whichever rank reads them: counted on the host from the rows' labels (each row read once
        and remembered), so every rank knows a whole step's count without communicating."""
        rows = np.asarray(self.indices(start, count), dtype=np.int64)
        unknown = np.unique(rows[self._targets[rows] < 0])
        if unknown.size:
            self._targets[unknown] = _targets_per_row(self._labels[unknown.tolist()]["labels"])
        return int(self._targets[rows].sum())


def _pairs_of(dataset) -> np.ndarray:
    """Pairs of every row of a preference dataset (``preference.pairs_per_row``), 1024 rows at a time."""
    from .preference import pairs_per_row

    chunks = range(0, len(dataset), 1024)
    parts = [pairs_per_row(dataset[i : i + 1024]["sequence_ids"]) for i in chunks]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


class EvalRows:
    """An eval dataset read in order, every row once, in fixed-shape batches."""

    def __init__(self, path: str | Path, reference: str | Path | None = None) -> None:
        self.dataset = _load(path)
        self.reference = _load(reference) if reference is not None else None
        self.num_rows = len(self.dataset)
        self._num_targets: int | None = None

    @property
    def num_targets(self) -> int:
        """Labelled positions over every row (counted once, on the host, 1024 rows at a time)."""
        if self._num_targets is None:
            chunks = range(0, self.num_rows, 1024)
            self._num_targets = sum(int(_targets_per_row(self.dataset[i : i + 1024]["labels"]).sum()) for i in chunks)
        return self._num_targets

    def batch(self, start: int, count: int) -> Batch:
        """Rows ``start .. start + count - 1``; past the end, empty rows (no targets)."""
        rows = list(range(start, min(start + count, self.num_rows)))
        return _batch(self.dataset, rows, pad_to=count, reference=self.reference)

    @property
    def num_pairs(self) -> int:
        """Preference pairs over every row (counted on the host)."""
        return int(_pairs_of(self.dataset).sum())
