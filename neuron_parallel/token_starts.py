"""Token ids and where each token starts in its text, from the Rust tokenizer, without its offsets.

The masks of chat, instruction and prompt/completion data need the position of each token's first
character (``neuron_parallel.sft``). ``Tokenizer.encode_batch`` reports it as offsets, but those
cost: the tokenizer tracks them through every step, and Python receives one tuple per token,
which on the tokenization benchmark took more time than the masks themselves. For the byte-level
BPE tokenizers of the Llama 3 and Qwen2/3 families the positions follow from the ids
alone: every token is a fixed byte string, and the tokens of a text are its UTF-8 bytes in order.
:class:`TokenStarts` then encodes with ``encode_batch_fast`` (no offsets) and takes each token's
start as the running sum of the byte lengths of the tokens before it: the start of the token's
first byte. The character rule and this byte rule agree: character spans start and end on
character boundaries, so a token's first byte lies in a span's bytes exactly when the character
holding that byte lies in the span.

Where the ids cannot say it, the offsets are used, so the result never differs from theirs:
- a tokenizer that is not of that kind (a model other than BPE, or one whose tokens carry a
  subword prefix or word suffix; a normalizer other than NFC; a pre-tokenizer without byte-level,
  or one that adds a prefix space; offsets trimmed by the post-processor): always;
- a batch holding a token outside the byte alphabet (a byte-fallback or unknown token), where the
  ids do not add up to each text's bytes (an added token that strips the whitespace beside it) or,
  under NFC, a text that is not NFC already: that batch.
"""

from __future__ import annotations

import json
import unicodedata
from concurrent.futures import ThreadPoolExecutor
from itertools import chain

import numpy as np


def encode_ids(backend, texts: list[str]) -> list:
    """``backend.encode_batch_fast`` of ``texts`` without special tokens: encodings whose ids are
    ``encode_batch``'s, without the offsets nothing here reads."""
    return backend.encode_batch_fast(texts, add_special_tokens=False)


PIECE = 256
"""Examples per piece of :func:`overlapped`: small enough that the first piece's preparation and
the last one's finish, which nothing overlaps, are a small part of a batch, large enough that
each encoding call spreads over the tokenizer's threads and that the calls are few: every call
ends with the tokenizer's threads idle while they wait for the next, and on the tokenization
benchmark's 2-core host the preference case took 2.9, 2.8 and 2.7 CPU seconds in pieces of 64,
128 and 256 examples (medians of 4), no less in pieces of 512 or 1,024."""


def overlapped(count: int, prepare, encode, finish, piece: int = PIECE) -> list:
    """``finish(p, encode(p))`` for ``p = prepare(a, b)`` of each consecutive range ``[a, b)`` of
    ``count`` examples, ``piece`` at most, in order, with each piece's ``encode`` on a second
    thread while this one finishes the piece before and prepares the next. The Rust tokenizer
    encodes with the GIL released, on every core; rendering and masks are Python, on one. In
    sequence, a core idles through every Python step (on the tokenization benchmark, about a third
    of a batch's time on 2 cores); overlapped, the tokenizer's threads take that core meanwhile."""
    pieces = max(-(-count // piece), 1)
    bounds = np.linspace(0, count, pieces + 1).astype(int).tolist()
    ranges = list(zip(bounds, bounds[1:]))
    out = []
    with ThreadPoolExecutor(1, thread_name_prefix="encode") as pool:
        running = None
        for a, b in ranges:
            prepared = prepare(a, b)
            encoding = pool.submit(encode, prepared)
            if running is not None:
                out.append(finish(running[0], running[1].result()))
            running = (prepared, encoding)
        out.append(finish(running[0], running[1].result()))
    return out


def flat_ids(encodings) -> tuple[np.ndarray, np.ndarray]:
    """``(ids of every encoding, one after another, as int32; each encoding's token count)``."""
    counts = np.fromiter(map(len, encodings), dtype=np.int64, count=len(encodings))
    flat = np.fromiter(chain.from_iterable(e.ids for e in encodings), dtype=np.int32, count=int(counts.sum()))
    return flat, counts


def id_lists(encodings, token: int | None, rows: np.ndarray | None, *, end: bool):
    """The ids of ``encodings`` as an Arrow list array, with ``token`` added at the end (or the
    start) of the ``rows`` marked (all: ``rows`` None and ``token`` given)."""
    import pyarrow as pa

    flat, counts = flat_ids(encodings)
    if token is not None and rows is None:
        rows = np.ones(len(counts), dtype=bool)
    if rows is not None and rows.any():
        ends = np.cumsum(counts)
        flat = np.insert(flat, (ends if end else ends - counts)[rows], token)
        counts = counts + rows
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat))


def _state(component) -> dict | None:
    return None if component is None else json.loads(component.__getstate__())


def _members(state: dict | None, kind: str) -> list[dict]:
    if state is None:
        return []
    return state[kind] if state["type"] == "Sequence" else [state]


class TokenStarts:
    """Encodes texts into ids and token start positions with a fast tokenizer's ``backend``
    (``tokenizers.Tokenizer``); see the module docstring. Picklable (the ``num_proc`` workers)."""

    def __init__(self, backend) -> None:
        self.backend = backend
        self.nfc = False
        self.nbytes: np.ndarray | None = None
        """Each token id's length in bytes (-1: not a byte string); None: the offsets are used."""
        self.from_offsets = 0
        """Batches whose starts came from the offsets."""
        self.why_not = self._why_not(backend)
        if self.why_not is None:
            self.nbytes = self._lengths(backend)

    def _why_not(self, backend) -> str | None:
        model = backend.model
        if type(model).__name__ != "BPE":
            return f"model {type(model).__name__}"
        if model.continuing_subword_prefix or model.end_of_word_suffix:
            return "BPE tokens carry a subword prefix or word suffix"
        normalizer = _state(backend.normalizer)
        if normalizer is not None and normalizer["type"] != "NFC":
            return f"normalizer {normalizer['type']}"
        self.nfc = normalizer is not None
        pre = _members(_state(backend.pre_tokenizer), "pretokenizers")
        levels = [p for p in pre if p["type"] == "ByteLevel"]
        if not levels:
            return "no byte-level pre-tokenizer"
        if any(p.get("add_prefix_space") for p in levels):
            return "the pre-tokenizer adds a prefix space"
        post = _members(_state(backend.post_processor), "processors")
        if any(p["type"] == "ByteLevel" and p.get("trim_offsets") for p in post):
            return "the post-processor trims offsets"
        return None

    @staticmethod
    def _lengths(backend) -> np.ndarray:
        from tokenizers import pre_tokenizers

        alphabet = set(pre_tokenizers.ByteLevel.alphabet())
        vocab = backend.get_vocab(with_added_tokens=False)
        added = backend.get_added_tokens_decoder()
        size = max([*vocab.values(), *added.keys(), -1]) + 1
        nbytes = np.full(size, -1, dtype=np.int64)
        for token, i in vocab.items():
            if alphabet.issuperset(token):
                nbytes[i] = len(token)
        for i, tok in added.items():
            nbytes[i] = len(tok.content.encode())
        return nbytes

    def tokenize(self, texts: list[str]) -> list | None:
        """The tokenizer's part (it runs without the GIL): the encodings of ``texts`` without
        offsets, or None where the ids cannot give the starts."""
        return encode_ids(self.backend, texts) if self.nbytes is not None else None

    def starts(self, texts: list[str], spans: list[list[tuple[int, int]]], encodings: list | None):
        """``(ids, counts, starts, lengths, spans)`` from :meth:`tokenize`'s ``encodings`` of
        ``texts``: every text's token ids one after another (int32), the tokens of each text, where
        each token starts within its text, each text's length and its character ``spans``,
        positions all in one unit: bytes of UTF-8 where the ids give them, characters where the
        offsets were used."""
        if encodings is not None:
            found = self._from_ids(texts, spans, encodings)
            if found is not None:
                return found
        self.from_offsets += 1
        encodings = self.backend.encode_batch(texts, add_special_tokens=False)
        ids, counts = flat_ids(encodings)
        starts = np.fromiter((s for e in encodings for s, _ in e.offsets), dtype=np.int64, count=len(ids))
        return ids, counts, starts, np.fromiter(map(len, texts), dtype=np.int64, count=len(texts)), spans

    def _from_ids(self, texts: list[str], spans: list[list[tuple[int, int]]], encodings: list):
        ascii_ = [t.isascii() for t in texts]
        if self.nfc and not all(a or unicodedata.is_normalized("NFC", t) for a, t in zip(ascii_, texts)):
            return None
        ids, counts = flat_ids(encodings)
        nbytes = self.nbytes[ids]
        if len(nbytes) and nbytes.min() < 0:
            return None
        before = np.concatenate([[0], np.cumsum(nbytes)])  # bytes before each token, in the whole batch
        first = np.cumsum(counts) - counts  # each text's first token
        lengths = np.fromiter(
            (len(t) if a else len(t.encode()) for t, a in zip(texts, ascii_)), dtype=np.int64, count=len(texts)
        )
        if not np.array_equal(before[first + counts] - before[first], lengths):
            return None
        spans = [
            ex if a or not ex else [(len(t[:s].encode()), len(t[:e].encode())) for s, e in ex]
            for t, ex, a in zip(texts, spans, ascii_)
        ]
        return ids, counts, before[:-1] - np.repeat(before[first], counts), lengths, spans
