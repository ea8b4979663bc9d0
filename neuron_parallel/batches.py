"""Reading tokenized rows back as training and eval batches.

A tokenized dataset (``neuron_parallel.data.tokenize_data``) holds rows of ``block_size``
tokens: ``input_ids``, ``labels`` (the target of each input position, ``IGNORE_INDEX`` where no
loss is taken) and, for datasets packed by document, ``position_ids`` that restart at 0 where
each document begins. A row without ``position_ids`` is one causal stream.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

IGNORE_INDEX = -100
"""The label of a position that takes no loss (a prompt token, padding, a document's end)."""


@dataclass(frozen=True, slots=True)
class Batch:
    """Rows of token ids, their targets, and (document-packed data) their positions, each
    ``(rows, block_size)``."""

    inputs: torch.Tensor
    labels: torch.Tensor
    positions: torch.Tensor | None = None

    @property
    def num_targets(self) -> int:
        """Positions that take a loss."""
        return int((self.labels != IGNORE_INDEX).sum())

    def split(self, count: int) -> list[Batch]:
        """Consecutive batches of ``count`` rows."""
        parts = [t.split(count) if t is not None else None for t in (self.inputs, self.labels, self.positions)]
        n = len(parts[0])
        return [Batch(parts[0][i], parts[1][i], parts[2][i] if parts[2] is not None else None) for i in range(n)]


def _load(path: str | Path):
    from datasets import load_from_disk

    return load_from_disk(str(path)).with_format("torch")


def _batch(dataset, indices: list[int], pad_to: int = 0) -> Batch:
    """Rows ``indices`` of ``dataset`` as a :class:`Batch`, followed by empty rows up to
    ``pad_to`` rows (token 0, no targets, positions ``0..block_size-1``), so that the batch
    shape stays fixed where the data runs out."""
    rows = dataset[indices] if indices else None
    columns = ("input_ids", "labels", "position_ids")
    has_positions = "position_ids" in dataset.column_names
    out = {c: rows[c].long() if rows is not None else None for c in columns if c != "position_ids" or has_positions}
    missing = pad_to - len(indices)
    if missing > 0:
        block = len(dataset[0]["input_ids"])
        empty = {
            "input_ids": torch.zeros(missing, block, dtype=torch.long),
            "labels": torch.full((missing, block), IGNORE_INDEX, dtype=torch.long),
            "position_ids": torch.arange(block).expand(missing, block),
        }
        for c in out:
            out[c] = empty[c] if out[c] is None else torch.cat([out[c], empty[c]])
    return Batch(out["input_ids"].contiguous(), out["labels"].contiguous(), out.get("position_ids"))


class BlockStream:
    """The order training reads packed rows in: a seeded permutation per epoch, consumed
    sequentially, so optimizer step ``s`` always sees global samples ``[s·G, (s+1)·G)``
    whatever the parallel layout and wherever a resumed run starts."""

    def __init__(self, path: str | Path, *, seed: int) -> None:
        self.dataset = _load(path)
        self.num_blocks = len(self.dataset)
        self.seed = seed
        self._perm: tuple[int, torch.Tensor] | None = None

    def _permutation(self, epoch: int) -> torch.Tensor:
        if self._perm is None or self._perm[0] != epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm = (epoch, torch.randperm(self.num_blocks, generator=g))
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
        return _batch(self.dataset, self.indices(start, count))


class EvalRows:
    """An eval dataset read in order, every row once, in fixed-shape batches."""

    def __init__(self, path: str | Path) -> None:
        self.dataset = _load(path)
        self.num_rows = len(self.dataset)

    def batch(self, start: int, count: int) -> Batch:
        """Rows ``start .. start + count - 1``; past the end, empty rows (no targets)."""
        return _batch(self.dataset, list(range(start, min(start + count, self.num_rows))), pad_to=count)
