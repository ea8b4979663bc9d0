"""Instruction and prompt/completion rendering and masks, mixing weighted sources, and the
evaluation rows (held out by seed, or a split of a dataset folder)."""

from __future__ import annotations

import json
import math

import pytest
from datasets import load_from_disk
from transformers import AutoTokenizer

from neuron_parallel.audit import audit_sample
from neuron_parallel.data import tokenize_dataset

from ..conftest import ROOT


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _examples(ds, tokenizer_dir):
    """Each row's first document as (text, trained text): packing false puts one per row."""
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    rows = load_from_disk(ds.path)
    out = []
    for i in range(len(rows)):
        sample = audit_sample(tok, rows.select([i]), stream=False)
        trained, at = "", 0
        for a, b in sample["masked_spans"]:
            trained, at = trained + sample["text"][at:a], b
        out.append((sample["text"], trained + sample["text"][at:]))
    return out


ALPACA = [
    {"instruction": "Name a loop statement.", "input": "", "output": "The for statement."},
    {"instruction": "Continue the passage.", "input": "The while statement", "output": " repeats a suite."},
]
DOLLY = [{"instruction": r["instruction"], "context": r["input"], "response": r["output"]} for r in ALPACA]


@pytest.mark.parametrize("rows", [ALPACA, DOLLY], ids=["alpaca", "dolly"])
def test_instruction_without_a_chat_template_uses_the_plain_prompt(tiny_world, tmp_path, rows):
    src = _jsonl(tmp_path / "inst.jsonl", rows)
    kw = dict(tokenizer_dir=tiny_world["model"], block_size=64, cache_dir=tmp_path / "c", packing=False)
    ds = tokenize_dataset(source=src, format="instruction", **kw)
    got = _examples(ds, tiny_world["model"])
    assert got[0] == (
        "### Instruction:\nName a loop statement.\n\n### Response:\nThe for statement.<|endoftext|>",
        "The for statement.<|endoftext|>",
    )
    assert got[1] == (
        "### Instruction:\nContinue the passage.\n\n### Input:\nThe while statement\n\n### Response:\n"
        " repeats a suite.<|endoftext|>",
        " repeats a suite.<|endoftext|>",
    )
    assert ds.attention == "document" and ds.audit["packing"] == "padded" and ds.audit["kept"] == 2


def test_instruction_with_the_tokenizers_chat_template_is_a_two_turn_chat(tiny_world, tmp_path):
    src = _jsonl(tmp_path / "inst.jsonl", ALPACA)
    kw = dict(tokenizer_dir=tiny_world["qwen2"], block_size=64, cache_dir=tmp_path / "c", packing=False)
    got = _examples(tokenize_dataset(source=src, format="instruction", **kw), tiny_world["qwen2"])
    assert got[1] == (
        "<|im_start|>user\nContinue the passage.\n\nThe while statement<|im_end|>\n"
        "<|im_start|>assistant\n repeats a suite.<|im_end|>\n",
        " repeats a suite.<|im_end|>\n",
    )


def test_prompt_completion_and_named_columns(tiny_world, tmp_path):
    rows = [{"q": "2 + 2 =", "a": " 4"}, {"q": "The capital of France is", "a": " Paris."}]
    src = _jsonl(tmp_path / "pc.jsonl", rows)
    kw = dict(tokenizer_dir=tiny_world["model"], block_size=32, cache_dir=tmp_path / "c", packing=False)
    ds = tokenize_dataset(source=src, format="prompt_completion", prompt_field="q", response_field="a", **kw)
    assert _examples(ds, tiny_world["model"]) == [
        ("2 + 2 = 4<|endoftext|>", " 4<|endoftext|>"),
        ("The capital of France is Paris.<|endoftext|>", " Paris.<|endoftext|>"),
    ]
    everything = tokenize_dataset(
        source=src, format="prompt_completion", prompt_field="q", response_field="a", train_on_prompt=True, **kw
    )
    text, trained = _examples(everything, tiny_world["model"])[0]
    tok = AutoTokenizer.from_pretrained(tiny_world["model"])
    first = tok.decode(tok(text, add_special_tokens=False)["input_ids"][:1])
    assert trained == text[len(first) :]  # all but the first token, which nothing predicts


def test_text_in_document_mode_trains_every_token_and_restarts_positions(tiny_world, tmp_path):
    ds = tokenize_dataset(
        source=tiny_world["corpus"], tokenizer_dir=tiny_world["model"], block_size=64, cache_dir=tmp_path, packing=True
    )
    rows = load_from_disk(ds.path).with_format("numpy")[:]
    assert ds.attention == "document" and set(rows) == {"input_ids", "labels", "position_ids"}
    assert (rows["position_ids"][:, 0] == 0).all() and ds.audit["truncated"] == 0
    assert ds.audit["examples"] == ds.audit["kept"] and ds.audit["fill"] > 0.95  # long documents fill rows


def _numbered(tmp_path, name, count):
    return _jsonl(tmp_path / f"{name}.jsonl", [{"text": f"{name} document number {i}"} for i in range(count)])


def _first_words(ds, tokenizer_dir):
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    return [tok.decode(row).split()[0] for row in load_from_disk(ds.path)["input_ids"]]


def test_weighted_sources_mix_by_seed_in_proportion(tiny_world, tmp_path):
    alpha, beta = _numbered(tmp_path, "alpha", 300), _numbered(tmp_path, "beta", 300)
    kw = dict(tokenizer_dir=tiny_world["model"], block_size=16, cache_dir=tmp_path / "c", packing=False)
    mixed = tokenize_dataset(source=[alpha, beta], weights=[3.0, 1.0], **kw)
    again = tokenize_dataset(
        source=[alpha, beta],
        weights=[3.0, 1.0],
        cache_dir=tmp_path / "again",
        **{k: v for k, v in kw.items() if k != "cache_dir"},
    )
    other = tokenize_dataset(source=[alpha, beta], weights=[3.0, 1.0], seed=1, **kw)
    words = _first_words(mixed, tiny_world["model"])
    assert words == _first_words(again, tiny_world["model"]) != _first_words(other, tiny_world["model"])
    assert words.count("alpha") == 300  # first_exhausted: the heavier source runs out first
    assert abs(words.count("alpha") / len(words) - 0.75) < 0.05
    assert mixed.fingerprint != tokenize_dataset(source=[alpha, beta], weights=[1.0, 1.0], **kw).fingerprint


def test_eval_fraction_holds_out_disjoint_examples_by_seed(tiny_world, tmp_path):
    src = _numbered(tmp_path, "doc", 100)
    kw = dict(source=src, tokenizer_dir=tiny_world["model"], block_size=16, packing=False, eval_fraction=0.2)
    a = tokenize_dataset(cache_dir=tmp_path / "a", **kw)
    b = tokenize_dataset(cache_dir=tmp_path / "b", **kw)
    c = tokenize_dataset(cache_dir=tmp_path / "c", seed=5, **kw)

    def rows(path):
        return {tuple(r) for r in load_from_disk(path)["input_ids"]}

    train, held = rows(a.path), rows(a.eval_path)
    assert len(held) == a.num_eval_blocks == a.audit["eval_examples"] == math.ceil(100 * 0.2)
    assert not train & held and len(train | held) == 100
    assert (rows(b.path), rows(b.eval_path)) == (train, held) and rows(c.eval_path) != held


def test_eval_split_of_a_dataset_folder(tiny_world, tmp_path):
    kw = dict(
        source=tiny_world["wikitext"],
        tokenizer_dir=tiny_world["model"],
        block_size=64,
        cache_dir=tmp_path,
        config="wikitext-2-raw-v1",
    )
    ds = tokenize_dataset(eval_split="validation", **kw)
    alone = tokenize_dataset(split="validation", **kw)
    assert ds.eval_path and ds.num_eval_blocks == alone.num_blocks > 0
    assert _ids(ds.eval_path) == _ids(alone.path)
    assert _ids(ds.path) == _ids(tokenize_dataset(**kw).path)


def _ids(path):
    return load_from_disk(path).with_format(None)[:]["input_ids"]


def test_the_tiny_chat_config_tokenizes_with_a_hold_out(tiny_world, tmp_path):
    from neuron_flows.tasks.config import FinetuneConfig
    from neuron_parallel.data import tokenize_data

    template = f"{tiny_world['chat_templates']}/llama3.jinja"  # the config names .tiny/chat_templates/llama3.jinja
    sets = [f"data.source={tiny_world['chat']}", f"data.cache_dir={tmp_path}", f"data.chat_template={template}"]
    config = FinetuneConfig.load(ROOT / "configs" / "tiny-chat-cpu.yaml", sets)
    ds = tokenize_data(config.library("data"), tiny_world["model"])
    assert ds.attention == "document" and ds.audit["eval_examples"] == 30 and ds.num_eval_blocks > 0
    assert ds.audit["dropped"] == 0 and 0.3 < ds.audit["trained_fraction"] < 0.9
    assert config.train.max_steps <= 20 and config.train.eval_every == 5
    # The base model's tokenizer has no chat template (hence data.chat_template); the instruct one's is ChatML.
    assert AutoTokenizer.from_pretrained(tiny_world["model"]).chat_template is None
    assert "<|im_start|>" in AutoTokenizer.from_pretrained(tiny_world["qwen2"]).chat_template
