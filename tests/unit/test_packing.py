"""Rows of whole documents (neuron_parallel.packing) on hand-made examples: positions restart at
every document, labels never reach across one, padding is its own masked document, and the
truncation, drop and split rules."""

import numpy as np
import pyarrow as pa
import pytest

from neuron_parallel.packing import IGNORE, document_rows, first_document

PAD = 0


def _table(examples):
    """Examples given as lists of (token, trained) pairs; tokens are >= 1 so pad (0) stands out."""
    ids = [[t for t, _ in ex] for ex in examples]
    trained = [[int(m) for _, m in ex] for ex in examples]
    return pa.table({"ids": pa.array(ids, pa.list_(pa.int32())), "trained": pa.array(trained, pa.list_(pa.int8()))})


def _rows(examples, block_size, **kw):
    kw = {"split_long": False, "one_per_row": False, **kw}
    out = document_rows(_table(examples), block_size=block_size, pad_id=PAD, **kw).to_pydict()
    return {k: np.asarray(v) for k, v in out.items()}


def _documents(row_ids, row_pos):
    """A row split where positions restart: [(start, end), ...]."""
    starts = [i for i, p in enumerate(row_pos) if p == 0]
    return list(zip(starts, starts[1:] + [len(row_ids)]))


def test_greedy_packing_positions_labels_and_padding():
    a = [(11, 0), (12, 0), (13, 1), (14, 1)]  # a prompt of 2, a response of 2
    b = [(21, 0), (22, 1), (23, 1)]
    c = [(31, 1), (32, 1), (33, 1), (34, 1), (35, 1)]
    rows = _rows([a, b, c], block_size=8)
    # a and b fit in row 0 (7 tokens); c does not fit in the 1 left, so it starts row 1.
    assert rows["input_ids"].tolist() == [[11, 12, 13, 14, 21, 22, 23, PAD], [31, 32, 33, 34, 35, PAD, PAD, PAD]]
    assert rows["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2, 0], [0, 1, 2, 3, 4, 0, 1, 2]]
    # labels[t] = token t+1 when trained; never the next document's first token; -100 on padding.
    assert rows["labels"].tolist() == [
        [IGNORE, 13, 14, IGNORE, 22, 23, IGNORE, IGNORE],
        [32, 33, 34, 35, IGNORE, IGNORE, IGNORE, IGNORE],
    ]
    assert rows["_kept"].tolist() == [2, 1] and rows["_tokens"].tolist() == [7, 5]
    assert rows["_trained"].tolist() == [4, 4] and rows["_truncated"].tolist() == [0, 0]
    for ids, pos, labels in zip(rows["input_ids"], rows["position_ids"], rows["labels"]):
        for _, end in _documents(ids, pos):
            assert labels[end - 1] == IGNORE  # the last token of a document predicts nothing


def test_packing_false_gives_each_example_its_own_padded_row():
    a = [(11, 0), (12, 1)]
    b = [(21, 1), (22, 1), (23, 1)]
    rows = _rows([a, b], block_size=4, one_per_row=True)
    assert rows["input_ids"].tolist() == [[11, 12, PAD, PAD], [21, 22, 23, PAD]]
    assert rows["position_ids"].tolist() == [[0, 1, 0, 1], [0, 1, 2, 0]]
    assert rows["labels"].tolist() == [[12, IGNORE, IGNORE, IGNORE], [22, 23, IGNORE, IGNORE]]


def test_truncation_and_drop_counts():
    long = [(i, 0) for i in range(1, 4)] + [(i, 1) for i in range(4, 9)]  # 8 tokens, trained from the 4th
    tail_only = [(i, 0) for i in range(1, 6)] + [(9, 1)]  # its only trained token is cut off
    untrained = [(5, 0), (6, 0)]
    first_only = [(7, 1), (8, 0)]  # token 0 is never a target, so nothing to predict
    fine = [(3, 0), (4, 1)]
    rows = _rows([long, tail_only, untrained, first_only, fine], block_size=5)
    assert rows["input_ids"].tolist() == [[1, 2, 3, 4, 5], [3, 4, PAD, PAD, PAD]]
    assert rows["labels"].tolist() == [[IGNORE, IGNORE, 4, 5, IGNORE], [4, IGNORE, IGNORE, IGNORE, IGNORE]]
    assert int(rows["_kept"].sum()) == 2 and int(rows["_truncated"].sum()) == 1


def test_text_documents_are_split_into_block_pieces_each_its_own_document():
    doc = [(i, 1) for i in range(1, 12)]  # 11 tokens, block 4: pieces of 4, 4, 3
    rows = _rows([doc], block_size=4, split_long=True)
    assert rows["input_ids"].tolist() == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, PAD]]
    assert rows["position_ids"].tolist() == [[0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 2, 0]]
    assert rows["labels"][:, -1].tolist() == [IGNORE] * 3  # no piece predicts the next piece
    assert rows["_kept"].tolist() == [1, 0, 0] and int(rows["_truncated"].sum()) == 0


def test_an_empty_batch_gives_no_rows():
    rows = _rows([[(5, 0)], [(6, 0), (7, 0)]], block_size=4)
    assert len(rows["input_ids"]) == 0


@pytest.mark.parametrize("with_positions", [True, False])
def test_first_document_of_a_row(with_positions):
    row = {"input_ids": [11, 12, 13, 21, 22, PAD], "labels": [IGNORE, 13, IGNORE, 22, IGNORE, IGNORE]}
    if with_positions:
        row["position_ids"] = [0, 1, 2, 0, 1, 0]
    ids, targets = first_document(row)
    assert ids.tolist() == ([11, 12, 13] if with_positions else row["input_ids"])
    assert targets.tolist()[:3] == [False, False, True]


def _reference_document_rows(examples, *, block_size, split_long, one_per_row):
    """``document_rows`` written document by document in plain Python, as the module docstring
    states it: ``examples`` as (ids, trained) lists, or ids alone (text, every token trained)."""
    pieces = []  # (example, ids, trained, truncated)
    for k, ex in enumerate(examples):
        ids, trained = ex if isinstance(ex, tuple) else (ex, [1] * len(ex))
        if split_long:
            starts = range(0, len(ids), block_size)
            parts = [(ids[s : s + block_size], trained[s : s + block_size], False) for s in starts]
        else:
            parts = [(ids[:block_size], trained[:block_size], len(ids) > block_size)]
        pieces += [(k, *p) for p in parts if sum(p[1][1:]) > 0]  # something to predict
    rows, used = [], block_size + 1
    for piece in pieces:
        if one_per_row or used + len(piece[1]) > block_size:
            rows.append([])
            used = 0
        rows[-1].append(piece)
        used += len(piece[1])
    out = {k: [] for k in ("input_ids", "labels", "position_ids", "_kept", "_truncated", "_tokens", "_trained")}
    seen = set()
    for members in rows:
        ids, labels, positions = [], [], []
        for _, toks, trained, _ in members:
            ids += toks
            positions += range(len(toks))
            labels += [t if m else IGNORE for t, m in zip(toks[1:], trained[1:])] + [IGNORE]
        pad = block_size - len(ids)
        out["input_ids"].append(ids + [PAD] * pad)
        out["labels"].append(labels + [IGNORE] * pad)
        out["position_ids"].append(positions + list(range(pad)))
        out["_kept"].append(sum(k not in seen for k, *_ in members))
        seen |= {k for k, *_ in members}
        out["_truncated"].append(sum(t for *_, t in members))
        out["_tokens"].append(len(ids))
        out["_trained"].append(sum(sum(m[1:]) for _, _, m, _ in members))
    return out


@pytest.mark.parametrize("text", [False, True], ids=["masked", "text"])
@pytest.mark.parametrize("fill_min_rows", [256, 1])
def test_document_rows_equal_the_document_by_document_rule(text, fill_min_rows, monkeypatch):
    """Random examples (empty, short, longer than a row; trained anywhere or nowhere) in batches of
    several Arrow chunks, every combination of split_long and one_per_row and several block sizes:
    the rows and counts of the plain rule, value for value, whether the rows are filled on one
    thread or in ranges on several (``packing.fill_rows``)."""
    from neuron_parallel import packing

    monkeypatch.setattr(packing, "FILL_MIN_ROWS", fill_min_rows)
    monkeypatch.setattr(packing, "usable_cores", lambda: 4)  # four ranges
    rng = np.random.default_rng(0)
    for block_size in (2, 5, 16, 33):
        lengths = rng.integers(0, 3 * block_size, size=90)
        ids = [rng.integers(1, 500, size=n).tolist() for n in lengths]
        trained = [(rng.random(n) < rng.random()).astype(int).tolist() for n in lengths]
        examples = ids if text else list(zip(ids, trained))
        columns = {"ids": pa.array(ids, pa.list_(pa.int32()))}
        if not text:
            columns["trained"] = pa.array(trained, pa.list_(pa.int8()))
        whole = pa.table(columns)
        table = pa.Table.from_batches([*whole.slice(0, 40).to_batches(), *whole.slice(40).to_batches()])
        for split_long in (False, True):
            for one_per_row in (False, True):
                kw = dict(block_size=block_size, split_long=split_long, one_per_row=one_per_row)
                got = document_rows(table, pad_id=PAD, **kw).to_pydict()
                assert got == _reference_document_rows(examples, **kw), (block_size, kw)
    assert document_rows(table.slice(0, 0), pad_id=PAD, **kw).num_rows == 0
