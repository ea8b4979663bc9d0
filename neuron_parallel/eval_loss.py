"""The eval loss of a Hugging Face causal LM over a run's tokenized eval rows, computed apart from
the training engine, with the run's loss rule:

- ``sft``: the summed next-token cross entropy over every labelled position, over their number
  (``neuron_parallel.train``'s loss rule);
- a preference objective (``dpo``, ``simpo``, ``orpo``): the mean over the eval pairs of the
  per-pair loss (``neuron_parallel.preference.pair_stats``, its ``PAIR_LOSS_RULE``), from each
  completion's summed log-probability under the model and, for dpo, under the reference model.

Each document of a packed row (where its positions restart at 0) is its own causal sequence, so
attention never crosses a document, as in training. Documents go through the model in
right-padded batches of similar length (the padding follows a document's tokens, so causal
attention never sees it); the logits are formed at most ``LOSS_CHUNK_BYTES`` at a time, and the
sums are added on the host in double precision.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

BATCH_TOKENS = 8192
"""Tokens (padding included) of the documents one forward pass takes."""


@dataclass(frozen=True)
class Objective:
    """What the eval loss is: the run's ``train.objective`` with its settings."""

    name: str = "sft"
    preference: Any = None
    """``train.preference`` (a ``PreferenceConfig``) for a preference objective."""
    reference: np.ndarray | None = None
    """dpo: the reference model's summed log-probability of each completion of the eval rows
    (:func:`completion_logps`' sums)."""


SFT = Objective()
"""The next-token loss of supervised fine-tuning."""


@dataclass(frozen=True, slots=True)
class Document:
    """One document of an eval row that has a labelled position."""

    ids: np.ndarray
    labels: np.ndarray
    positions: np.ndarray
    row: int
    sequence: int
    """The sequence id of its labelled positions (preference rows: ``2k`` chosen, ``2k + 1``
    rejected of the row's k-th pair); -1 for rows without sequence ids."""


def precision_context(device, precision: str):
    """The forward passes' context: bf16 autocast for a bf16 run, as training computes."""
    import torch

    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def documents(rows) -> list[Document]:
    """Every document of the eval ``rows`` (a numpy-format ``datasets.Dataset``) with a labelled
    position: a row of document-packed data splits where its positions restart at 0, a stream
    row is one document."""
    import numpy as np

    from .batches import IGNORE_INDEX

    docs = []
    columns = rows.column_names
    for start in range(0, len(rows), 1024):
        chunk = rows[start : start + 1024]
        for r, ids in enumerate(chunk["input_ids"]):
            labels = np.asarray(chunk["labels"][r])
            positions = np.asarray(chunk["position_ids"][r]) if "position_ids" in columns else np.arange(len(ids))
            sequences = np.asarray(chunk["sequence_ids"][r]) if "sequence_ids" in columns else None
            bounds = sorted({0, *np.flatnonzero(positions == 0).tolist(), len(ids)})
            for s, e in zip(bounds, bounds[1:]):
                if (labels[s:e] != IGNORE_INDEX).any():
                    sequence = int(sequences[s:e].max()) if sequences is not None else -1
                    docs.append(Document(np.asarray(ids[s:e]), labels[s:e], positions[s:e], start + r, sequence))
    return docs


def labelled_logps(model, docs: list[Document], *, precision: str = "fp32") -> Iterator[tuple[Document, np.ndarray]]:
    """Each of ``docs`` with the log-probability ``model`` gives each of its labelled targets
    (computed in fp32, returned as float64 for the sums taken on the host; in position order)."""
    import numpy as np
    import torch

    from .batches import IGNORE_INDEX
    from .planning.attention import loss_chunk_tokens

    device = next(model.parameters()).device
    decoder, head = model.get_decoder(), model.get_output_embeddings()
    chunk = loss_chunk_tokens(head.out_features)
    docs = sorted(docs, key=lambda d: len(d.ids))
    i = 0
    with torch.no_grad(), precision_context(device, precision):
        while i < len(docs):
            j = i + 1
            while j < len(docs) and (j + 1 - i) * len(docs[j].ids) <= max(BATCH_TOKENS, len(docs[i].ids)):
                j += 1
            batch, i = docs[i:j], j
            width = len(batch[-1].ids)
            ids = np.zeros((len(batch), width), dtype=np.int64)
            labels = np.full((len(batch), width), IGNORE_INDEX, dtype=np.int64)
            positions = np.broadcast_to(np.arange(width), (len(batch), width)).copy()
            mask = np.zeros((len(batch), width), dtype=np.int64)
            for b, doc in enumerate(batch):
                n = len(doc.ids)
                ids[b, :n], labels[b, :n], positions[b, :n], mask[b, :n] = doc.ids, doc.labels, doc.positions, 1
            hidden = decoder(
                input_ids=torch.from_numpy(ids).to(device),
                attention_mask=torch.from_numpy(mask).to(device),
                position_ids=torch.from_numpy(positions).to(device),
            ).last_hidden_state.flatten(0, 1)
            targets = torch.from_numpy(labels).to(device).flatten()
            # fp32 on the device (torch-neuronx computes float64 as float32); float64 from the host on,
            # where the sums are taken.
            logps = torch.zeros(targets.shape, dtype=torch.float32, device=device)
            for s in range(0, targets.numel(), chunk):
                part = targets[s : s + chunk]
                taken = head(hidden[s : s + chunk]).float().log_softmax(-1)
                taken = taken.gather(-1, part.clamp(min=0).unsqueeze(-1)).squeeze(-1)
                logps[s : s + chunk] = torch.where(part != IGNORE_INDEX, taken, 0.0)
            logps = logps.view(len(batch), width).cpu().numpy().astype(np.float64)
            for b, doc in enumerate(batch):
                yield doc, logps[b, : len(doc.ids)][doc.labels != IGNORE_INDEX]


def completion_logps(model, rows, *, precision: str = "fp32") -> tuple[np.ndarray, np.ndarray]:
    """``(sums, counts)`` of preference ``rows``, each ``(rows, pairs, 2)``: per pair slot the
    summed log-probability under ``model`` and the token count of its chosen ``[..., 0]`` and
    rejected ``[..., 1]`` completion (the layout of ``preference.sequence_logps``)."""
    import numpy as np

    from .preference import slots

    shape = (len(rows), slots(len(rows[0]["input_ids"])) // 2, 2)
    sums, counts = np.zeros(shape), np.zeros(shape)
    for doc, logps in labelled_logps(model, documents(rows), precision=precision):
        pair, side = divmod(doc.sequence, 2)
        sums[doc.row, pair, side] += logps.sum()
        counts[doc.row, pair, side] += len(logps)
    return sums, counts


def eval_loss(model, eval_path: str, *, precision: str = "fp32", objective: Objective = SFT) -> tuple[float, int]:
    """``(eval loss, labelled positions)`` of ``model`` over the tokenized eval rows at
    ``eval_path``, by ``objective`` (see the module docstring)."""
    from datasets import load_from_disk

    rows = load_from_disk(eval_path).with_format("numpy")
    if objective.name == "sft":
        total, count = 0.0, 0
        for _, logps in labelled_logps(model, documents(rows), precision=precision):
            total -= float(logps.sum())
            count += len(logps)
        return total / max(count, 1), count
    import torch

    from .preference import pair_stats

    sums, counts = completion_logps(model, rows, precision=precision)
    reference = torch.from_numpy(objective.reference) if objective.reference is not None else None
    sums_t, counts_t = torch.from_numpy(sums), torch.from_numpy(counts)
    stats = pair_stats(objective.name, objective.preference, sums_t, counts_t, reference)
    pairs = int((counts[..., 0] > 0).sum())
    return float(stats[0]) / max(pairs, 1), int(counts.sum())
