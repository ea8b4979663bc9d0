"""Every refusal of the data side names the problem and the fix, and writes nothing."""

from __future__ import annotations

import json

import pytest

from neuron_parallel.config import DataConfig
from neuron_parallel.data import tokenize_dataset
from neuron_parallel.tiny import TEMPLATES

CHATML = str(TEMPLATES / "chatml.jinja")
HELLO = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


def _chat(tmp_path, *conversations):
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in conversations))
    return str(path)


def _tokenize(tiny_world, tmp_path, source, **kw):
    kw = {"tokenizer_dir": tiny_world["model"], "block_size": 64, "cache_dir": tmp_path / "c", **kw}
    try:
        return tokenize_dataset(source=source, **kw)
    finally:
        assert not (tmp_path / "c").exists() or not any((tmp_path / "c").iterdir())  # nothing written


@pytest.mark.parametrize(
    ("conversation", "match"),
    [
        ([], r"data.source row 1: the conversation is empty; each row needs a non-empty list of \{role, content\}"),
        ([{"role": "user"}], r"row 1: message 0 is not a dict with a role and a string content"),
        ([{"role": "user", "content": ["a", "b"]}], r"row 1: message 0 is not a dict with a role and a string content"),
        ([{"role": "bot", "content": "hi"}], r"row 1: message 0 has role 'bot'; .*system, user, assistant, tool"),
    ],
    ids=["empty", "no-content", "content-not-text", "unknown-role"],
)
def test_bad_conversations_name_the_row_and_the_problem(tiny_world, tmp_path, conversation, match):
    src = _chat(tmp_path, HELLO, conversation)
    with pytest.raises(ValueError, match=match):
        _tokenize(tiny_world, tmp_path, src, format="chat", chat_template=CHATML)


def test_a_missing_column_names_the_columns_found(tiny_world, tmp_path):
    with pytest.raises(
        ValueError, match=r"no messages column 'messages'; columns: \['text'\]; set data.messages_field"
    ):
        _tokenize(tiny_world, tmp_path, tiny_world["corpus"], format="chat", chat_template=CHATML)
    with pytest.raises(
        ValueError, match=r"no instruction column 'instruction'; columns: \['text'\]; set data.prompt_field"
    ):
        _tokenize(tiny_world, tmp_path, tiny_world["corpus"], format="instruction")
    with pytest.raises(
        ValueError, match=r"no completion column 'answer'; columns: \['text'\]; set data.response_field"
    ):
        _tokenize(
            tiny_world, tmp_path, tiny_world["corpus"], format="prompt_completion", prompt_field="text",
            response_field="answer",
        )  # fmt: skip


def test_chat_without_a_template_names_the_setting(tiny_world, tmp_path):
    with pytest.raises(ValueError, match=r"needs a chat template.*set data.chat_template: path/to/template.jinja"):
        _tokenize(tiny_world, tmp_path, _chat(tmp_path, HELLO), format="chat")


def test_no_trainable_token_is_refused(tiny_world, tmp_path):
    src = _chat(tmp_path, [{"role": "user", "content": "hi"}], [{"role": "system", "content": "be brief"}])
    with pytest.raises(ValueError, match=r"no training example has a token to train on \(2 examples\); check"):
        _tokenize(tiny_world, tmp_path, src, format="chat", chat_template=CHATML)


def test_a_template_that_is_not_the_concatenation_of_its_turns_is_refused(tiny_world, tmp_path):
    odd = tmp_path / "odd.jinja"  # the last turn rendered differently from the same turn followed by others
    odd.write_text(
        "{% for m in messages %}{{ m['role'] }}{% if loop.last %}!{% endif %}: {{ m['content'] }}\n{% endfor %}"
    )
    with pytest.raises(ValueError, match=r"does not render a conversation as the concatenation of its turns"):
        _tokenize(tiny_world, tmp_path, _chat(tmp_path, HELLO), format="chat", chat_template=str(odd))


def test_an_eval_split_of_plain_files_is_refused(tiny_world, tmp_path):
    with pytest.raises(ValueError, match=r"data.eval_split='validation' names a split .* point data.eval_source"):
        _tokenize(tiny_world, tmp_path, tiny_world["corpus"], eval_split="validation")


def test_too_small_a_hold_out_is_refused(tiny_world, tmp_path):
    with pytest.raises(ValueError, match=r"data.eval_fraction=0.5 of 1 examples leaves no training or no evaluation"):
        _tokenize(tiny_world, tmp_path, _chat(tmp_path, HELLO), format="chat", chat_template=CHATML, eval_fraction=0.5)


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"eval_fraction": 1.0}, r"data.eval_fraction must be 0 \(no hold-out\) or between 0 and 1 exclusive, got 1.0"),
        ({"eval_fraction": -0.1}, r"data.eval_fraction must be 0 .* got -0.1"),
        ({"eval_fraction": 0.1, "eval_split": "validation"}, r"does not go with data.eval_source or data.eval_split"),
        ({"eval_split": "train"}, r"data.eval_split='train' is data.split: the evaluation examples would be the"),
        ({"weights": [1.0, 2.0]}, r"data.weights has 2 entries but data.source has 1; give data.source as a list"),
        ({"source": ["a", "b", "c"], "weights": [1.0, 2.0]}, r"data.weights has 2 entries but data.source has 3"),
        ({"source": ["a", "b"], "weights": [1.0, 0.0]}, r"data.weights must all be positive numbers"),
        ({"chat_template": "nope.jinja"}, r"data.chat_template='nope.jinja' is not a file"),
        ({"format": "markdown"}, r"data.format='markdown' is not one of"),
        ({"input_field": "context"}, r"data.input_field applies to data.format=instruction only"),
        ({"format": "chat", "response_field": "answer"}, r"data.response_field applies to data.format instruction or"),
    ],
)
def test_config_refusals(fields, match):
    with pytest.raises(ValueError, match=match):
        DataConfig(**fields)
