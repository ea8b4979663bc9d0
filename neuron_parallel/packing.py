"""Tokenized examples into fixed-length rows: the stream, packed documents, or one padded example
per row.

Every row has ``input_ids`` and ``labels`` of ``block_size`` int32 tokens; ``labels[t]`` is the
target of input position t (already shifted), -100 where there is no loss.

- Stream (format text, packing unset): as Hugging Face's run_clm, documents are concatenated and
  cut into pieces of ``block_size + 1`` tokens (the remainder of each batch of documents is
  dropped); a piece gives ``input_ids = piece[:-1]`` and ``labels = piece[1:]``, and attention is
  plainly causal across the row.
- Documents (packing true or false): rows also carry ``position_ids``, restarting at 0 at every
  document. A document of tokens t0..t(L-1) occupies L consecutive inputs at positions 0..L-1
  with ``labels[i] = t(i+1)`` when token i+1 is trained, else -100, and ``labels[L-1] = -100``:
  nothing is predicted across documents. Packing true places documents greedily in order: each
  goes into the current row if it fits, else starts a new one. Packing false gives each its own
  row. The rest of a row is padding (the pad token, else EOS) with labels -100 and positions
  0, 1, 2, ..., its own document, so attention never crosses into or out of it.

The batch functions take and return Arrow tables (``datasets.map`` in arrow format) and add
per-row count columns (prefixed ``_``) from which ``count_columns`` sums the audit's numbers.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

IGNORE = -100
PACK_BATCH = 10_000
"""Examples per packing batch: rows never span two batches, so a larger batch drops (stream) or
pads (documents) less at batch edges."""
COUNTS = ("_kept", "_truncated", "_tokens", "_trained")


def _flat(table: pa.Table, name: str) -> tuple[np.ndarray, np.ndarray]:
    """A list column as its flat values and row offsets starting at 0."""
    col = table.column(name).combine_chunks()
    offsets = col.offsets.to_numpy()
    return col.flatten().to_numpy(zero_copy_only=False), offsets - offsets[0]


def _rows(values: np.ndarray, block_size: int) -> pa.FixedSizeListArray:
    return pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1).astype(np.int32, copy=False)), block_size)


def _table(block_size: int, counts: dict[str, np.ndarray], **rows: np.ndarray) -> pa.Table:
    cols = {name: _rows(v, block_size) for name, v in rows.items()}
    return pa.table({**cols, **{k: pa.array(v.astype(np.int64)) for k, v in counts.items()}})


def stream_rows(table: pa.Table, *, block_size: int) -> pa.Table:
    """Concatenate the batch's documents and cut rows of ``block_size + 1`` tokens (the stream)."""
    ids, _ = _flat(table, "ids")
    n = len(ids) // (block_size + 1)
    pieces = ids[: n * (block_size + 1)].reshape(n, block_size + 1)
    full = np.full(n, block_size)
    counts = {"_kept": np.zeros(n), "_truncated": np.zeros(n), "_tokens": full, "_trained": full}
    return _table(block_size, counts, input_ids=pieces[:, :-1], labels=pieces[:, 1:])


def _pieces(offsets: np.ndarray, block_size: int, split_long: bool):
    """Each example's pieces as (example, flat start, length, truncated): a text document cut
    into ``block_size`` pieces, or an example truncated to its first ``block_size`` tokens."""
    lengths = np.diff(offsets)
    count = -(-lengths // block_size) if split_long else np.ones_like(lengths)
    example = np.repeat(np.arange(len(lengths)), count)
    k = np.arange(len(example)) - np.repeat(np.cumsum(count) - count, count)
    start = offsets[:-1][example] + k * block_size
    length = np.minimum(lengths[example] - k * block_size, block_size)
    truncated = (lengths[example] > block_size) & (not split_long)
    return example, start, length, truncated


def _greedy(lengths: np.ndarray, block_size: int, one_per_row: bool) -> tuple[np.ndarray, np.ndarray]:
    """Row and column of each document: greedily in order (or one per row)."""
    if one_per_row:
        return np.arange(len(lengths)), np.zeros(len(lengths), dtype=np.int64)
    rows, cols = np.empty(len(lengths), dtype=np.int64), np.empty(len(lengths), dtype=np.int64)
    row, used = 0, 0
    for i, n in enumerate(lengths.tolist()):  # sequential by nature: where one goes depends on the last
        if used + n > block_size:
            row, used = row + 1, 0
        rows[i], cols[i] = row, used
        used += n
    return rows, cols


def document_rows(table: pa.Table, *, block_size: int, pad_id: int, split_long: bool, one_per_row: bool) -> pa.Table:
    """Rows of whole documents with their own positions (see the module docstring) from a batch
    of ``ids`` and ``trained`` lists."""
    ids, offsets = _flat(table, "ids")
    # Text trains every token and carries no ``trained`` column.
    trained = _flat(table, "trained")[0] if "trained" in table.column_names else np.ones(len(ids), dtype=np.int8)
    example, start, length, truncated = _pieces(offsets, block_size, split_long)
    # A token is a target when it is trained and not the first of its piece.
    tok_piece = np.repeat(np.arange(len(start)), length)
    tok_src = np.arange(len(tok_piece)) - np.repeat(np.cumsum(length) - length, length) + start[tok_piece]
    first = tok_src == start[tok_piece]
    is_target = (trained[tok_src] != 0) & ~first
    targets = np.bincount(tok_piece, weights=is_target, minlength=len(start)).astype(np.int64)

    keep = targets > 0  # a piece with nothing to predict carries no loss
    example, start, length, truncated, targets = (a[keep] for a in (example, start, length, truncated, targets))
    row, col = _greedy(length, block_size, one_per_row)
    num_rows = int(row[-1]) + 1 if len(row) else 0

    tok = np.repeat(np.arange(len(start)), length)
    pos = np.arange(len(tok)) - np.repeat(np.cumsum(length) - length, length)
    src = start[tok] + pos
    dest = row[tok] * block_size + col[tok] + pos
    nxt = np.minimum(src + 1, len(ids) - 1)
    label = np.where((pos < length[tok] - 1) & (trained[nxt] != 0), ids[nxt], IGNORE)

    used = np.bincount(row, weights=length, minlength=num_rows).astype(np.int64)
    columns = np.arange(block_size, dtype=np.int32)
    input_ids = np.full(num_rows * block_size, pad_id, dtype=np.int32)  # the rows' own dtype: no copy to convert
    labels = np.full(num_rows * block_size, IGNORE, dtype=np.int32)
    positions = np.maximum(columns[None, :] - used[:, None].astype(np.int32), 0).reshape(-1)  # padding counts from 0
    input_ids[dest], labels[dest], positions[dest] = ids[src], label, pos

    # An example counts as kept in the row holding its first kept piece.
    first_piece = np.r_[True, example[1:] != example[:-1]] if len(example) else np.zeros(0, dtype=bool)
    counts = {
        "_kept": np.bincount(row[first_piece], minlength=num_rows),
        "_truncated": np.bincount(row, weights=truncated, minlength=num_rows),
        "_tokens": used,
        "_trained": np.bincount(row, weights=targets, minlength=num_rows),
    }
    return _table(block_size, counts, input_ids=input_ids, labels=labels, position_ids=positions)


def count_columns(dataset) -> dict[str, int]:
    """The sums of the count columns of packed rows, by name without the ``_``."""
    import pyarrow.compute as pc

    return {name[1:]: int(pc.sum(dataset.data.column(name)).as_py() or 0) for name in COUNTS}


def first_document(row: dict) -> tuple[np.ndarray, np.ndarray]:
    """The tokens of the first document of a row and, for each, whether it carries loss (is a
    target): the whole row when it has no ``position_ids``."""
    ids = np.asarray(row["input_ids"])
    targets = np.r_[False, np.asarray(row["labels"])[:-1] != IGNORE]
    if "position_ids" in row:
        restarts = np.flatnonzero(np.asarray(row["position_ids"])[1:] == 0)
        end = int(restarts[0]) + 1 if len(restarts) else len(ids)
        ids, targets = ids[:end], targets[:end]
    return ids, targets
