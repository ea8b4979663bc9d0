"""Token starts from the ids (``neuron_parallel.token_starts``) give the masks the offsets give:
on texts with multi-byte characters, special tokens, whitespace runs and random spans, for the
byte-level tokenizer as the Llama 3 family configures it, under NFC as Qwen2's does, and where
the ids cannot tell (offsets trimmed, a prefix space, a word suffix, an added token that strips
whitespace, a text that NFC would change) through the offsets; and ``overlapped``, which encodes
each piece of a batch on a second thread while the Python work of its neighbours runs."""

from __future__ import annotations

import random

import numpy as np
import pytest
from tokenizers import AddedToken, Tokenizer, normalizers, pre_tokenizers, processors

from neuron_parallel.sft import in_spans, masked_table
from neuron_parallel.token_starts import TokenStarts

PIECES = [
    "How does a for loop work?",
    " ",
    "\n\n",
    "  padded  ",
    "\ttab",
    "é ünïcode ✓ 中文 🙂",
    "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "<|eot_id|>",
    "<|im_start|>user\n",
    "word " * 7,
    "e\u0301",  # e + combining acute: NFC makes it one character
    "\ue000",
]


def _texts(seed: int, count: int, pieces=PIECES) -> list[tuple[str, list[tuple[int, int]], bool]]:
    """Examples as ``masked_table`` takes them: text, sorted disjoint character spans, EOS or not."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 8)))
        cuts = sorted(set(rng.sample(range(len(text) + 1), min(len(text) + 1, 2 * rng.randint(0, 3)))))
        out.append((text, list(zip(cuts[::2], cuts[1::2])), i % 3 == 0))
    return out


def _by_offsets(backend, rendered, eos: int) -> dict[str, list]:
    """The masks by their definition: each encoding's own offsets, example by example."""
    ids, trained = [], []
    for text, spans, add in rendered:
        enc = backend.encode(text, add_special_tokens=False)
        starts = np.asarray([s for s, _ in enc.offsets], dtype=np.int64)
        ids.append(enc.ids + [eos] * add)
        trained.append([int(t) for t in in_spans(starts, spans)] + [1] * add)
    return {"ids": ids, "trained": trained}


def _backend(tiny_world, which: str = "model") -> Tokenizer:
    return Tokenizer.from_file(f"{tiny_world[which]}/tokenizer.json")


def _variant(tiny_world, change: str) -> Tokenizer:
    backend = _backend(tiny_world)
    if change == "nfc":
        backend.normalizer = normalizers.NFC()
    elif change == "trimmed offsets":
        backend.post_processor = processors.ByteLevel(trim_offsets=True)
    elif change == "prefix space":
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    elif change == "lowercase":
        backend.normalizer = normalizers.Lowercase()
    elif change == "word suffix":
        backend.model.end_of_word_suffix = "</w>"
    elif change == "stripping added token":
        backend.add_special_tokens([AddedToken("<|strip|>", lstrip=True, rstrip=True)])
    return backend


@pytest.mark.parametrize("which", ["model", "qwen2"])
def test_starts_from_the_ids_give_the_masks_of_the_offsets(tiny_world, which):
    backend = _backend(tiny_world, which)
    tokens = TokenStarts(backend)
    assert tokens.why_not is None
    for seed in range(4):
        rendered = _texts(seed, 200)
        got = masked_table(tokens, rendered, eos=0).to_pydict()
        assert got == _by_offsets(backend, rendered, eos=0)
    assert tokens.from_offsets == 0  # every batch from the ids
    assert any(not text.isascii() for text, _, _ in rendered) and any(sum(t) for t in got["trained"])


def test_under_nfc_a_text_nfc_would_change_takes_the_offsets(tiny_world):
    backend = _variant(tiny_world, "nfc")
    tokens = TokenStarts(backend)
    assert tokens.why_not is None and tokens.nfc
    nfc = _texts(0, 100, [p for p in PIECES if p != "e\u0301"])
    assert masked_table(tokens, nfc, eos=0).to_pydict() == _by_offsets(backend, nfc, eos=0)
    assert tokens.from_offsets == 0
    changed = nfc + [("cafe\u0301 ok", [(2, 6)], True)]
    assert masked_table(tokens, changed, eos=0).to_pydict() == _by_offsets(backend, changed, eos=0)
    assert tokens.from_offsets == 1


@pytest.mark.parametrize(
    "change, reason",
    [
        ("trimmed offsets", "post-processor trims offsets"),
        ("prefix space", "prefix space"),
        ("lowercase", "normalizer Lowercase"),
        ("word suffix", "word suffix"),
    ],
)
def test_tokenizers_the_ids_cannot_place_take_the_offsets(tiny_world, change, reason):
    backend = _variant(tiny_world, change)
    tokens = TokenStarts(backend)
    assert reason in tokens.why_not
    rendered = _texts(5, 150)
    assert masked_table(tokens, rendered, eos=0).to_pydict() == _by_offsets(backend, rendered, eos=0)
    assert tokens.from_offsets == 1


def test_a_batch_where_the_ids_miss_bytes_takes_the_offsets(tiny_world):
    backend = _variant(tiny_world, "stripping added token")
    tokens = TokenStarts(backend)
    assert tokens.why_not is None
    plain = _texts(6, 50)
    assert masked_table(tokens, plain, eos=0).to_pydict() == _by_offsets(backend, plain, eos=0)
    assert tokens.from_offsets == 0
    stripped = plain + [("a  <|strip|>  b", [(0, 3), (12, 15)], False)]
    assert masked_table(tokens, stripped, eos=0).to_pydict() == _by_offsets(backend, stripped, eos=0)
    assert tokens.from_offsets == 1


@pytest.mark.parametrize("count", [0, 1, 3, 8, 50])
def test_overlapped_finishes_every_piece_once_in_order(count):
    """Each range of examples is prepared, encoded (on another thread) and finished once, the
    ranges cover the examples in order, and the results come back in that order."""
    import threading

    from neuron_parallel.token_starts import overlapped

    main, seen = threading.get_ident(), []

    def encode(prepared):
        seen.append(threading.get_ident())
        return [x * 10 for x in prepared]

    out = overlapped(count, lambda a, b: list(range(a, b)), encode, lambda p, e: (p, e), piece=3)
    assert [x for p, _ in out for x in p] == list(range(count))
    assert all(e == [x * 10 for x in p] for p, e in out) and len(out) == max(-(-count // 3), 1)
    assert main not in seen


def test_overlapped_raises_what_a_piece_raises():
    """A refusal while preparing a later piece (a bad row) reaches the caller as it was raised."""
    from neuron_parallel.token_starts import overlapped

    def prepare(a, b):
        if b > 6:
            raise ValueError(f"row {b - 1}: bad")
        return (a, b)

    with pytest.raises(ValueError, match="row 9: bad"):
        overlapped(10, prepare, lambda p: p, lambda p, e: e, piece=5)
    with pytest.raises(ZeroDivisionError):
        overlapped(10, lambda a, b: b - a, lambda n: 1 / (n - 5), lambda p, e: e, piece=5)
