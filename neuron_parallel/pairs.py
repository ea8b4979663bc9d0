"""Preference pairs as rows: the tokenization and packing of ``data.format: preference``; the
objectives that train on the rows are ``neuron_parallel.preference``'s.

Data (``data.format: preference``). Each example has a prompt, a chosen and a rejected
completion (columns ``data.prompt_field``/``chosen_field``/``rejected_field``, default prompt,
chosen, rejected).

- String values are tokenized as TRL's ``DPOTrainer.tokenize_row`` did (TRL 0.x; TRL 1.x
  tokenizes prompt + completion as one text): the prompt's ids with BOS first where the tokenizer
  defines one, each completion's ids followed by EOS, each of the three tokenized alone without
  special tokens, so that a pair's prompt is the same ids in both documents. A completion's
  log-probability is the sum over its ids and the EOS.
- Chat message lists: the prompt is rendered with the chat template and the generation prompt; a
  completion (a list of assistant messages, or a string taken as one assistant message) is what
  rendering prompt + completion adds to that, all of it trained (the assistant turn with its end
  marker, as chat SFT trains it); prompt and completion are tokenized alone, without special
  tokens (the template writes its own).

A pair becomes two documents of one row, ``prompt + chosen`` then ``prompt + rejected``, each with
positions from 0 (the document mask keeps them apart); the prompt's tokens take no loss.
``sequence_ids`` tells, per labelled position, which completion it belongs to: ``2k`` for the
chosen and ``2k + 1`` for the rejected completion of the row's k-th pair, -1 where there is no
label. Pairs are packed greedily into rows (``data.packing: false``: one pair per row). A pair
longer than ``data.block_size`` loses tokens from the start of its prompt (the same in both
documents) until it fits, and is counted as truncated; if even a prompt of one token leaves no
room for both completions whole, the pair is dropped (counted).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np

from .config import DataConfig
from .packing import IGNORE, index_dtype, row_segments, segments
from .token_starts import encode_ids, id_lists, overlapped
from .utils import gc_paused

# -- tokenization ----------------------------------------------------------------------------------


def pair_columns(data: DataConfig, columns: list[str], where: str) -> dict[str, str]:
    """The prompt, chosen and rejected columns; ValueError naming the missing one and its field."""
    out = {}
    for role, key, name in (
        ("prompt", "prompt_field", data.prompt_field or "prompt"),
        ("chosen", "chosen_field", data.chosen_field),
        ("rejected", "rejected_field", data.rejected_field),
    ):
        if name not in columns:
            raise ValueError(
                f"data.format=preference: {where} has no {role} column {name!r}; columns: {columns}; "
                f"set data.{key} to one of them"
            )
        out[role] = name
    return out


class PairEncoder:
    """The batched ``datasets.map`` function of one preference source: ``prompt``, ``chosen`` and
    ``rejected`` token ids per pair (see the module docstring), as Arrow list columns. Picklable
    for ``num_proc``."""

    def __init__(self, data: DataConfig, tokenizer, columns: dict[str, str], where: str) -> None:
        from .chat import ChatRenderer
        from .sft import chat_template

        self.data, self.tokenizer, self.columns, self.where = data, tokenizer, columns, where
        self.template = chat_template(data, tokenizer)
        name = data.chat_template or f"the chat template of the tokenizer {tokenizer.name_or_path}"
        self.chat = ChatRenderer(tokenizer, self.template, name) if self.template is not None else None

    def __call__(self, batch: dict[str, list], indices: list[int]):
        """``datasets.map``'s batched function: a batch of Python column lists."""
        from .sft import batch_piece

        with gc_paused():
            return self._pairs(partial(batch_piece, batch), indices)

    def encode_dataset(self, dataset):
        """Every row of ``dataset``, its three columns formatted as Python a piece at a time
        (``sft.dataset_piece``)."""
        from .sft import arrow_piece, dataset_piece, plain_chat

        with gc_paused():
            columns = dataset.select_columns(list(set(self.columns.values())))
            piece = partial(dataset_piece, columns)
            types = dict(zip(columns.data.schema.names, columns.data.schema.types))
            c = self.columns
            if (
                self.chat is not None
                and plain_chat(types[c["prompt"]], False)
                and all(plain_chat(types[c[role]], True) for role in ("chosen", "rejected"))
            ):  # message lists of role and content only: pieces stay Arrow (_flat_texts)
                piece = partial(arrow_piece, columns.with_format("arrow"))
            return self._pairs(piece, range(len(dataset)))

    def _pairs(self, piece, indices):
        """``piece(a, b)``: rows ``a`` to ``b`` as Python column lists; ``indices``: their row numbers."""
        import pyarrow as pa

        backend = self.tokenizer.backend_tokenizer
        tables = overlapped(
            len(indices),
            lambda a, b: self._texts(piece(a, b), [f"{self.where} row {indices[j]}" for j in range(a, b)]),
            # Every prompt, then every chosen, then every rejected text, in one call: one dispatch.
            lambda prepared: encode_ids(backend, [t[k] for k in range(3) for t in prepared[0]]),
            lambda prepared, every: pa.table(self._columns(*prepared, every)),
        )
        return pa.concat_tables(tables)

    def _texts(self, columns, wheres: list[str]) -> tuple[list, np.ndarray]:
        """The ``(prompt, chosen, rejected)`` texts of the rows in ``columns`` (Python column
        lists, or an Arrow table of plain message lists), and which of them are string pairs
        (TRL's ``tokenize_row``), the others rendered chats."""
        if not isinstance(columns, dict):
            texts = self._flat_texts(columns, wheres)
            if texts is not None:
                return texts, np.zeros(len(wheres), dtype=bool)
            columns = columns.to_pydict()
        c = self.columns
        texts: list = [None] * len(wheres)
        chats: list[tuple[int, list[dict], list[dict], list[dict], str]] = []
        for j, (where, prompt, chosen, rejected) in enumerate(
            zip(wheres, columns[c["prompt"]], columns[c["chosen"]], columns[c["rejected"]])
        ):
            for role, value in (("chosen", chosen), ("rejected", rejected)):
                if value in (None, "", []):
                    raise ValueError(
                        f"{where}: the {role} completion (column {c[role]!r}) is empty; every pair needs a "
                        f"non-empty chosen and rejected completion: fix or remove the row"
                    )
            if isinstance(prompt, list):
                chats.append((j, *self._chat_pair(prompt, chosen, rejected, where), where))
            elif isinstance(prompt, str | None) and isinstance(chosen, str) and isinstance(rejected, str):
                texts[j] = (prompt or "", chosen, rejected)
            else:
                raise ValueError(
                    f"{where}: a pair's prompt, chosen and rejected values must be strings, or chat message lists "
                    f"(the prompt a list of messages); got {type(prompt).__name__}, {type(chosen).__name__}, "
                    f"{type(rejected).__name__}: fix the data"
                )
        plain = np.asarray([t is not None for t in texts], dtype=bool)
        if chats:
            split = self.chat.split_pairs([c[1:4] for c in chats], [c[4] for c in chats])
            for (j, *_), rendered in zip(chats, split):
                texts[j] = rendered
        return texts, plain

    def _flat_texts(self, table, wheres: list[str]) -> list | None:
        """The texts of an Arrow piece of chat pairs whose messages are role and content only,
        read as flat columns (``ChatRenderer.split_flat_pairs``): no dictionary per message, no
        check per message (Arrow's are per column). None where a value is missing or empty or a
        role unknown: the Python path names the row. Pairs not written from layouts go that way
        too."""
        from .sft import flat_messages

        c = self.columns
        flats = [flat_messages(table.column(c[role])) for role in ("prompt", "chosen", "rejected")]
        if any(flat is None for flat in flats):
            return None
        texts = self.chat.split_flat_pairs(*flats, wheres)
        rest = [j for j, text in enumerate(texts) if text is None]
        if rest:
            done, _ = self._texts(table.take(rest).to_pydict(), [wheres[j] for j in rest])
            for j, text in zip(rest, done):
                texts[j] = text
        return texts

    def _columns(self, texts: list, plain: np.ndarray, every: list) -> dict:
        """The ``prompt``, ``chosen`` and ``rejected`` id lists of ``texts`` from their encodings
        ``every`` (every prompt, then every chosen, then every rejected completion)."""
        tok, n = self.tokenizer, len(texts)
        bos = tok.bos_token_id
        columns = {}
        for k, name in enumerate(("prompt", "chosen", "rejected")):
            encodings = every[k * n : (k + 1) * n]
            if k == 0:  # BOS + prompt
                columns[name] = id_lists(encodings, bos, plain if bos is not None else None, end=False)
            else:  # completion + EOS
                columns[name] = id_lists(encodings, tok.eos_token_id, plain, end=True)
        return columns

    def _chat_pair(self, prompt: list, chosen: Any, rejected: Any, where: str) -> tuple[list, list, list]:
        """The prompt and each completion as checked message lists (a string completion is one
        assistant message)."""
        from .sft import check_messages

        if self.template is None:
            raise ValueError(
                f"{where}: chat message pairs need a chat template, but the tokenizer has none; set "
                "data.chat_template: path/to/template.jinja (e.g. neuron_parallel/chat_templates/chatml.jinja)"
            )
        out = [check_messages(prompt, where)]
        for role, value in (("chosen", chosen), ("rejected", rejected)):
            turns = [{"role": "assistant", "content": value}] if isinstance(value, str) else value
            out.append(check_messages(turns, f"{where} ({role})"))
        return out[0], out[1], out[2]


def pair_features():
    from datasets import Features, List, Value

    return Features({name: List(Value("int32")) for name in ("prompt", "chosen", "rejected")})


# -- rows --------------------------------------------------------------------------------------------


def fit_pair(p: int, c: int, r: int, block_size: int) -> int | None:
    """Prompt tokens to drop from the start so that a pair of prompt ``p``, completions ``c`` and
    ``r`` tokens fits one row (0: it fits), or None when even one prompt token leaves no room."""
    need = 2 * p + c + r
    if need <= block_size:
        return 0
    cut = -(-(need - block_size) // 2)
    return cut if p - cut >= 1 else None


def pair_rows(table, *, block_size: int, pad_id: int, one_per_row: bool):
    """Rows of pairs (see the module docstring) from an Arrow batch of ``prompt``, ``chosen`` and
    ``rejected`` lists, with the count columns of ``neuron_parallel.packing``. Built as
    ``packing.document_rows`` builds its rows: each kept pair is four segments, prompt, chosen,
    prompt, rejected, and every position of the rows reads its token through one source index
    (``packing.segments``); only the greedy placement runs per pair. A completion token is the
    label of the position before it in its document; the first position of a document has none
    before it (an empty prompt: the first completion token is not predicted)."""
    from .packing import _flat, _greedy, _table, fill_rows, in_order, padding_starts

    values, starts, lengths = [], [], []
    for name in ("prompt", "chosen", "rejected"):
        flat, offsets = _flat(table, name)
        starts.append(offsets[:-1] + sum(len(v) for v in values))  # into the three concatenated
        lengths.append(np.diff(offsets))
        values.append(flat)
    n = sum(len(v) for v in values)
    tokens = np.concatenate([*values, [pad_id]]).astype(np.int32, copy=False)  # index n: the padding's token
    p, c, r = lengths
    need = 2 * p + c + r  # fit_pair for every pair at once
    cut = np.where(need > block_size, -(-(need - block_size) // 2), 0)
    kept = np.flatnonzero((need <= block_size) | (p - cut >= 1))
    cut, p, c, r = cut[kept], p[kept] - cut[kept], c[kept], r[kept]
    size = 2 * p + c + r
    row, col = _greedy(size, block_size, one_per_row)
    num_rows = int(row[-1]) + 1 if len(row) else 0
    first = np.r_[True, row[1:] != row[:-1]] if len(row) else np.zeros(0, dtype=bool)
    slot = np.arange(len(row)) - np.flatnonzero(first)[np.cumsum(first) - 1]  # the pair's place in its row
    used = np.bincount(row, weights=size, minlength=num_rows).astype(np.int32)

    # Per pair, segments prompt, chosen, prompt, rejected: place, source start, first position
    # and sequence id (-1 for a prompt); then each row's padding, reading the token at index n.
    at = row * block_size + col
    zero, none = np.zeros_like(p), np.full_like(p, -1)
    prompt_src = starts[0][kept] + cut
    columns = (
        (at, at + p, at + p + c, at + 2 * p + c),
        (prompt_src, starts[1][kept], prompt_src, starts[2][kept]),
        (zero, p, zero, p),
        (none, 2 * slot, none, 2 * slot + 1),
    )
    seg_at, seg_src, seg_pos, seg_id = (np.stack(cols, axis=1).reshape(-1) for cols in columns)
    nonempty = np.stack([p, c, p, r], axis=1).reshape(-1) > 0  # an empty prompt has no segment
    pad_at = padding_starts(used, block_size)
    pads = len(pad_at)
    seg_at, seg_src, seg_pos, seg_id = in_order(
        np.r_[seg_at[nonempty], pad_at],
        np.r_[seg_src[nonempty], np.full(pads, n)],
        np.r_[seg_pos[nonempty], np.zeros(pads, dtype=seg_pos.dtype)],
        np.r_[seg_id[nonempty], np.full(pads, -1, dtype=seg_id.dtype)],
    )
    counts = {
        "_kept": np.bincount(row, minlength=num_rows),
        "_truncated": np.bincount(row, weights=cut > 0, minlength=num_rows),
        "_tokens": used,
        "_trained": np.bincount(row, weights=c + r - 2 * (p == 0), minlength=num_rows),
    }
    fill = partial(_fill_pairs, tokens, block_size, seg_at, seg_src, seg_pos, seg_id)
    return _table(block_size, counts, **fill_rows(fill, ROW_COLUMNS, num_rows, block_size))


ROW_COLUMNS = ("input_ids", "labels", "position_ids", "sequence_ids")


def _fill_pairs(tokens, block_size: int, seg_at, seg_src, seg_pos, seg_id, out: dict, first: int, end: int) -> None:
    """Rows ``first`` to ``end`` of :func:`pair_rows` into ``out`` (flat rows by column), from the
    segments of every row (``packing.row_segments``); ``tokens[-1]`` is the padding's token."""
    these, at, a, total = row_segments(seg_at, block_size, first, end)
    n = len(tokens) - 1
    src = segments(at, seg_src[these], total, step=1, dtype=index_dtype(n + block_size, total))
    input_ids, labels, positions, sequence_ids = (out[name][a : a + total] for name in ROW_COLUMNS)
    tokens.take(src, mode="clip", out=input_ids)  # a padding segment's indices run past n: clipped to it
    segments(at, seg_pos[these], total, step=1, dtype=np.int32, out=positions)  # padding counts from 0
    segment_ids = segments(at, seg_id[these], total, step=0, dtype=np.int32)
    # Position t is labelled when t + 1 holds a completion token with a position before it; the
    # last position of a row never is (the next row starts at position 0).
    target = segment_ids[1:] >= 0
    target &= positions[1:] > 0
    labels.fill(IGNORE)
    sequence_ids.fill(-1)
    np.copyto(labels[:-1], input_ids[1:], where=target)
    np.copyto(sequence_ids[:-1], segment_ids[1:], where=target)
