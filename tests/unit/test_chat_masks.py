"""The must-show check of chat SFT: on every row of a generated multi-turn chat set (system
prompts, several assistant turns), with both shipped templates, loss falls exactly on the
assistant turns.

The expected mask is recomputed here, independently of neuron_parallel.sft: each assistant
turn is located in the rendered text by its content followed by the template's end marker, and
a token is trained when its first character lies in such a span. The same checker must catch a
mask that also trains on the user turns."""

from __future__ import annotations

import json

import numpy as np
import pytest
from datasets import load_from_disk
from transformers import AutoTokenizer

from neuron_parallel.data import tokenize_dataset
from neuron_parallel.packing import IGNORE
from neuron_parallel.tiny import TEMPLATES

END = {"chatml": "<|im_end|>\n", "llama3": "<|eot_id|>"}
"""What each template writes after a turn's content."""
BLOCK = 256


def turn_spans(text: str, messages: list[dict], roles: set[str], end: str) -> list[tuple[int, int]]:
    """Character spans of the turns with a role in ``roles``: content plus end marker, found in
    order in the rendered text."""
    spans, at = [], 0
    for m in messages:
        piece = m["content"].strip() + end
        found = text.index(piece, at)
        if m["role"] in roles:
            spans.append((found, found + len(piece)))
        at = found + len(piece)
    return spans


def expected_document(tokenizer, text: str, spans) -> tuple[list[int], list[int]]:
    """The ids and labels of one document, truncated to a row: label t is token t+1 when that
    token starts inside a span, else -100; the last label is -100."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = enc["input_ids"][:BLOCK]
    trained = [any(a <= s < b for a, b in spans) for s, _ in enc["offset_mapping"][:BLOCK]]
    labels = [ids[i + 1] if trained[i + 1] else IGNORE for i in range(len(ids) - 1)] + [IGNORE]
    return ids, labels


def mask_problems(tokenizer, row_ids, row_labels, text, spans) -> list[str]:
    """What is wrong with one document's ids and labels, against the expected mask."""
    ids, labels = expected_document(tokenizer, text, spans)
    if list(row_ids) != ids:
        return ["the tokens differ from the rendered text"]
    return [f"label {i}: {a} != {b}" for i, (a, b) in enumerate(zip(row_labels, labels)) if a != b]


def documents(rows):
    """Every (ids, labels) document of packed rows in order, padding left out: a document starts
    where positions restart, and padding is the trailing all-pad document with no label."""
    out = []
    for ids, labels, pos in zip(rows["input_ids"], rows["labels"], rows["position_ids"]):
        starts = list(np.flatnonzero(pos == 0)) + [len(ids)]
        for a, b in zip(starts, starts[1:]):
            out.append((ids[a:b].tolist(), labels[a:b].tolist()))
    return out


def _tokenize_chat(tiny_world, cache_dir, template: str, **data):
    """The tiny world's chat set tokenized with ``template`` (and any other data fields)."""
    return tokenize_dataset(
        source=tiny_world["chat"],
        tokenizer_dir=tiny_world["model"],
        block_size=BLOCK,
        cache_dir=cache_dir,
        format="chat",
        chat_template=template,
        **data,
    )


@pytest.fixture(scope="module")
def conversations(tiny_world):
    return [json.loads(line)["messages"] for line in open(tiny_world["chat"])]


@pytest.mark.parametrize("packing", [True, False])
@pytest.mark.parametrize("template", ["chatml", "llama3"])
def test_loss_is_exactly_on_every_assistant_turn(tiny_world, conversations, tmp_path, template, packing):
    path = str(TEMPLATES / f"{template}.jinja")
    ds = _tokenize_chat(tiny_world, tmp_path, path, packing=packing)
    tok = AutoTokenizer.from_pretrained(tiny_world["model"])
    rows = load_from_disk(ds.path).with_format("numpy")[:]
    docs = documents(rows)
    pad = tok.pad_token_id
    real = [d for d in docs if not (set(d[0]) == {pad} and set(d[1]) == {IGNORE})]
    assert len(real) == len(conversations) == ds.audit["kept"]  # none dropped, order kept
    assert any(len(m) > 4 and m[0]["role"] == "system" for m in conversations)  # the set is multi-turn
    wrong_caught = 0
    for messages, (ids, labels) in zip(conversations, real):
        text = tok.apply_chat_template(messages, tokenize=False, chat_template=open(path).read())
        spans = turn_spans(text, messages, {"assistant"}, END[template])
        assert len(spans) == sum(m["role"] == "assistant" for m in messages)
        assert mask_problems(tok, ids, labels, text, spans) == []
        # A mask that also trains on the user turns is caught by the same checker.
        wrong_spans = sorted(spans + turn_spans(text, messages, {"user"}, END[template]))
        _, wrong_labels = expected_document(tok, text, wrong_spans)
        wrong_caught += bool(mask_problems(tok, ids, wrong_labels, text, spans))
    assert wrong_caught == len(conversations)
    assert ds.audit["trained_tokens"] == int((rows["labels"] != IGNORE).sum())
    if not packing:
        assert ds.num_blocks == len(conversations)


def test_the_audit_marks_exactly_the_spans_without_loss(tiny_world, conversations, tmp_path):
    path = str(TEMPLATES / "chatml.jinja")
    ds = _tokenize_chat(tiny_world, tmp_path, path)
    sample = ds.audit["sample"]
    tok = AutoTokenizer.from_pretrained(tiny_world["model"])
    first = tok.apply_chat_template(conversations[0], tokenize=False, chat_template=open(path).read())
    assert sample["text"] == first
    trained, at = "", 0
    for a, b in sample["masked_spans"]:
        trained, at = trained + first[at:a], b
    trained += first[at:]
    assert trained == "".join(m["content"] + "<|im_end|>\n" for m in conversations[0] if m["role"] == "assistant")
    assert sample["marked"].replace("«", "").replace("»", "") == first
    assert sample["marked"].count("«") == len(sample["masked_spans"])
    assert json.loads((tmp_path / ds.fingerprint / "audit.json").read_text()) == ds.audit
