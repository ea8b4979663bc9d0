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

from functools import partial

import numpy as np
import pyarrow as pa

from .utils import usable_cores

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


def index_dtype(*sizes: int) -> type:
    """int32 for indices into (and values of) arrays of at most ``sizes`` elements, where they fit
    with room for the sums of two; else int64. Half the memory of int64 to write and read."""
    return np.int32 if max(sizes, default=0) < 1 << 30 else np.int64


def segments(starts: np.ndarray, firsts: np.ndarray, total: int, *, step: int, dtype, out=None) -> np.ndarray:
    """``total`` values in segments: segment k runs from ``starts[k]`` up to the next start (the last
    to ``total``) and holds ``firsts[k]``, ``firsts[k] + step``, ``firsts[k] + 2 * step``, ... (step
    1: a ramp, as positions or source indices; step 0: a constant). ``starts`` increase strictly
    from 0. One prefix sum over one array of the result's size: rows are built from these instead
    of per-token index arrays, because every array a batch touches for the first time costs the
    page faults of its memory, which on a small host took longer than the arithmetic (the
    tokenization benchmark's profile). Into ``out`` where given (``total`` values of ``dtype``)."""
    if out is None:
        out = np.full(total, step, dtype=dtype)
    else:
        out.fill(step)
    if total:
        ends = np.append(starts[1:], total)
        lasts = firsts + step * (ends - starts - 1)
        out[starts[0]] = firsts[0]
        out[starts[1:]] = firsts[1:] - lasts[:-1]
        np.add.accumulate(out, out=out)
    return out


FILL_MIN_ROWS = 256
"""Rows below which :func:`fill_rows` fills on one thread."""


def fill_rows(fill, names: tuple[str, ...], num_rows: int, block_size: int) -> dict[str, np.ndarray]:
    """Flat int32 rows of columns ``names``, filled by ``fill(out, first, end)`` in consecutive
    ranges of rows, one per core (up to 4) at once. ``fill`` is NumPy work on large arrays, which
    releases the GIL; it runs after every example is encoded, with nothing else to keep the other
    cores busy (on the tokenization benchmark's 2-core host, a tenth of the preference case)."""
    from concurrent.futures import ThreadPoolExecutor

    out = {name: np.empty(num_rows * block_size, dtype=np.int32) for name in names}
    parts = max(1, min(4, usable_cores(), num_rows // FILL_MIN_ROWS))
    if parts == 1:
        fill(out, 0, num_rows)
        return out
    bounds = np.linspace(0, num_rows, parts + 1).astype(int).tolist()
    with ThreadPoolExecutor(parts - 1, thread_name_prefix="rows") as pool:
        done = [pool.submit(fill, out, a, b) for a, b in zip(bounds[1:-1], bounds[2:])]
        fill(out, bounds[0], bounds[1])
        for future in done:
            future.result()
    return out


def row_segments(at: np.ndarray, block_size: int, start: int, end: int) -> tuple[slice, np.ndarray, int, int]:
    """The segments of rows ``start`` to ``end`` among those of every row (starts ``at``,
    increasing, a row's first position always among them): which they are, their starts counted
    from the first row's first position, that position and the rows' length in positions."""
    a, b = start * block_size, end * block_size
    lo, hi = np.searchsorted(at, [a, b])
    return slice(int(lo), int(hi)), at[lo:hi] - a, a, b - a


def padding_starts(used: np.ndarray, block_size: int) -> np.ndarray:
    """Where each row's padding starts in the flat rows, for the rows with ``used`` below full."""
    short = np.flatnonzero(used < block_size)
    return short * block_size + used[short]


def in_order(starts: np.ndarray, *columns: np.ndarray) -> list[np.ndarray]:
    """``starts`` and ``columns`` (one value per segment) sorted by start."""
    order = np.argsort(starts, kind="stable")
    return [starts[order], *(c[order] for c in columns)]


def document_rows(table: pa.Table, *, block_size: int, pad_id: int, split_long: bool, one_per_row: bool) -> pa.Table:
    """Rows of whole documents with their own positions (see the module docstring) from a batch
    of ``ids`` and ``trained`` lists. The rows are read from the flat ids through one source
    index per position (:func:`segments`); a row's padding reads a sentinel index past the ids."""
    ids, offsets = _flat(table, "ids")
    # Text trains every token and carries no ``trained`` column.
    trained = _flat(table, "trained")[0] if "trained" in table.column_names else None
    example, start, length, truncated = _pieces(offsets, block_size, split_long)
    # A piece's targets: its tokens after the first that are trained (a running count of them).
    n = len(ids)
    if trained is None:
        targets = np.maximum(length - 1, 0)
    else:
        counted = np.zeros(n + 1, dtype=index_dtype(n))
        np.cumsum(trained, dtype=counted.dtype, out=counted[1:])
        targets = np.where(length > 0, counted[start + length] - counted[np.minimum(start + 1, n)], 0)

    keep = targets > 0  # a piece with nothing to predict carries no loss
    example, start, length, truncated, targets = (a[keep] for a in (example, start, length, truncated, targets))
    row, col = _greedy(length, block_size, one_per_row)
    num_rows = int(row[-1]) + 1 if len(row) else 0
    used = np.bincount(row, weights=length, minlength=num_rows).astype(np.int64)

    # Segments of the rows: the pieces, then each row's padding, reading from index n on.
    pad_at = padding_starts(used, block_size)
    at, first = in_order(np.r_[row * block_size + col, pad_at], np.r_[start, np.full(len(pad_at), n)])
    ids = ids.astype(np.int32, copy=False)
    names = ("input_ids", "labels", "position_ids")
    rows = fill_rows(partial(_fill_documents, ids, trained, pad_id, block_size, at, first), names, num_rows, block_size)

    # An example counts as kept in the row holding its first kept piece.
    first_piece = np.r_[True, example[1:] != example[:-1]] if len(example) else np.zeros(0, dtype=bool)
    counts = {
        "_kept": np.bincount(row[first_piece], minlength=num_rows),
        "_truncated": np.bincount(row, weights=truncated, minlength=num_rows),
        "_tokens": used,
        "_trained": np.bincount(row, weights=targets, minlength=num_rows),
    }
    return _table(block_size, counts, **rows)


def _fill_documents(ids, trained, pad_id: int, block_size: int, at, first, out: dict, start: int, end: int) -> None:
    """Rows ``start`` to ``end`` of :func:`document_rows` into ``out`` (flat rows by column), from
    the segments of every row (:func:`row_segments`); a segment reading from ``len(ids)`` on is
    padding."""
    these, seg, a, total = row_segments(at, block_size, start, end)
    n = len(ids)
    src = segments(seg, first[these], total, step=1, dtype=index_dtype(n + block_size, total))
    input_ids, labels, positions = (out[name][a : a + total] for name in ("input_ids", "labels", "position_ids"))
    segments(seg, np.zeros_like(seg), total, step=1, dtype=np.int32, out=positions)  # padding counts from 0 too
    padding = src >= n
    ids.take(src, mode="clip", out=input_ids)
    np.copyto(input_ids, pad_id, where=padding)
    # labels[t] = the token at t + 1 when it continues t's piece and is trained; never past a row.
    target = positions[1:] > 0
    target &= ~padding[1:]
    if trained is not None:
        target &= trained.take(src[1:], mode="clip") != 0
    labels.fill(IGNORE)
    np.copyto(labels[:-1], input_ids[1:], where=target)


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
