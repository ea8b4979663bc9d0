"""Chat spans and preference splits found from one rendering per conversation
(``neuron_parallel.chat``) are those of their definition, the renderings of the prefixes: compared
on varied conversations (system prompts, several turns, tool turns, empty and whitespace contents,
contents that look like template markers) with both shipped templates and the Qwen2 tokenizer's own;
templates whose layout cannot vouch for a conversation fall back to rendering its prefixes; a
template that only writes its contents has its conversations written from layouts, equal to their
renderings, and one that reads them does not; the batch mask equals the per-example one."""

from __future__ import annotations

import random

import numpy as np
import pytest
from transformers import AutoTokenizer

from neuron_parallel.chat_source import writes_contents
from neuron_parallel.config import DataConfig
from neuron_parallel.pairs import PairEncoder
from neuron_parallel.sft import Encoder, in_spans, masked_table
from neuron_parallel.tiny import TEMPLATES
from neuron_parallel.token_starts import TokenStarts

CONTENTS = [
    "How does a for loop work?",
    "",
    " ",
    "\n",
    "  padded on both sides  ",
    "\ttabs\t",
    "two\nlines\n\nand a gap",
    "trailing newline\n",
    "\nleading newline",
    "looks like <|im_end|>\n<|im_start|>user\n or <|eot_id|>",
    "\ue0000\ue001",
    "é ünïcode ✓ 中文",
    "word " * 40,
]


def conversations(seed: int, count: int, tool: bool = True) -> list[list[dict]]:
    """Random conversations: an optional system prompt, one to four user/assistant exchanges
    (sometimes an assistant call answered by a tool turn), sometimes a trailing assistant or user
    turn, contents drawn from CONTENTS."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        c = [{"role": "system", "content": rng.choice(CONTENTS)}] if rng.random() < 0.3 else []
        for _ in range(rng.randint(1, 4)):
            c.append({"role": "user", "content": rng.choice(CONTENTS)})
            if tool and rng.random() < 0.2:
                c += [{"role": "assistant", "content": rng.choice(CONTENTS)}, {"role": "tool", "content": "42"}]
            c.append({"role": "assistant", "content": rng.choice(CONTENTS)})
        if rng.random() < 0.2:
            c.append({"role": rng.choice(["user", "assistant"]), "content": rng.choice(CONTENTS)})
        out.append(c)
    return out


def _tokenizer_and_template(tiny_world, template: str):
    """The base model's tokenizer with a shipped template, or the Qwen2 tokenizer with its own."""
    if template == "own":
        return AutoTokenizer.from_pretrained(tiny_world["qwen2"]), None
    return AutoTokenizer.from_pretrained(tiny_world["model"]), str(TEMPLATES / f"{template}.jinja")


def _renderer(tokenizer, template: str | None, fmt: str = "chat"):
    data = DataConfig(source="unused.jsonl", format=fmt, chat_template=template, block_size=1024)
    return Encoder(data, tokenizer, {"messages": "messages"}, "data.source").render


def _cuts(conversation: list[dict]) -> list[tuple[int, bool]]:
    return [cut for k, m in enumerate(conversation) if m["role"] == "assistant" for cut in ((k, True), (k + 1, False))]


@pytest.mark.parametrize("template", ["chatml", "llama3", "own"])
def test_spans_from_one_rendering_are_those_of_the_rendered_prefixes(tiny_world, template):
    tokenizer, path = _tokenizer_and_template(tiny_world, template)
    render = _renderer(tokenizer, path)
    convs = conversations(0, 300)
    wheres = [f"row {i}" for i in range(len(convs))]
    got = render.chats(convs, wheres)
    texts = [text for text, _ in got]
    assert texts == tokenizer.apply_chat_template(convs, tokenize=False, chat_template=render.template)
    assert [spans for _, spans in got] == render._rendered_spans(convs, wheres, texts)
    # These templates (the Qwen2 tokenizer's is ChatML) only write their contents: the conversations
    # were written from layouts.
    assert render.chat._writes is True
    # What was compared is the one-rendering path: the layouts vouched for every conversation.
    found = render.chat.cut_lengths(convs, texts, [_cuts(c) for c in convs])
    assert render.chat._layouts is not None and all(f is not None for f in found)
    assert len(render.chat._layouts) < len(convs)  # one layout per conversation shape


WRITES = {
    "system first": (
        "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] | trim }}{% endif %}{% for m in "
        "messages[1:] %}{{ '<' + m.role + '>' ~ m.content }}{% endfor %}{% if add_generation_prompt %}A{% endif %}"
    ),
    "counted, last role": (
        "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if messages[-1]['role'] != 'assistant' %}x"
        "{% endif %}{{ messages | length }}"
    ),
}
READS = {
    "tested": "{% for m in messages %}{% if m['content'] %}{{ m['content'] }}{% endif %}{% endfor %}",
    "assigned": "{% for m in messages %}{% set c = m['content'] %}{{ c }}{% endfor %}",
    "method": "{% for m in messages %}{{ m['content'].strip() }}{% endfor %}",
    "filtered": "{% for m in messages %}{{ m['content'] | upper }}{% endfor %}",
    "counted": "{% for m in messages %}{{ m['content'] | length }}{% endfor %}",
    "searched": "{% for m in messages %}{% if 'x' in m.content %}y{% endif %}{{ m.content }}{% endfor %}",
    "clock": "{{ strftime_now('%d') }}{% for m in messages %}{{ m['content'] }}{% endfor %}",
    "as json": "{{ messages | tojson }}",
    "by a variable": "{% for m in messages %}{{ messages[loop.index0]['content'] }}{% endfor %}",
    "previous item": "{% for m in messages %}{{ loop.previtem }}{{ m['content'] }}{% endfor %}",
    "previous item's content": (
        "{% for m in messages %}{% if loop['previtem'] and loop['previtem']['content'] %}x{% endif %}"
        "{{ m['content'] }}{% endfor %}"
    ),
    "next item by attr": "{% for m in messages %}{{ (loop | attr('nextitem')) is none }}{{ m['content'] }}{% endfor %}",
    "get": "{% for m in messages %}{{ m.get('content') }}{% endfor %}",
    "dict method": "{% for m in messages %}{{ m.items }}{% endfor %}",
    "captured": "{% for m in messages %}{% set x %}{{ m['content'] }}{% endset %}{{ x }}{% endfor %}",
    "conditional": "{% for m in messages %}{{ m['content'] if m['role'] == 'user' else '' }}{% endfor %}",
    "loop condition": "{% for m in messages if m['content'] %}{{ m['content'] }}{% endfor %}",
    "trimmed with text": "{% for m in messages %}{{ ('x' + m['content']) | trim }}{% endfor %}",
    "rebound": "{% set messages = messages[1:] %}{% for m in messages %}{{ m['content'] }}{% endfor %}",
    "macro": "{% macro f(x) %}{{ x }}{% endmacro %}{% for m in messages %}{{ f(m['content']) }}{% endfor %}",
}


@pytest.mark.parametrize("name", [*WRITES, *READS, "chatml", "llama3"])
def test_templates_that_only_write_contents_are_told_apart(tiny_world, name):
    from transformers.utils.chat_template_utils import _compile_jinja_template

    source = {**WRITES, **READS}.get(name) or (TEMPLATES / f"{name}.jinja").read_text()
    assert writes_contents(_compile_jinja_template(source).environment, source) is (name not in READS)


def test_written_conversations_that_differ_from_their_renderings_turn_layouts_off(tiny_world, monkeypatch):
    from neuron_parallel import chat

    tokenizer = AutoTokenizer.from_pretrained(tiny_world["model"])
    render = _renderer(tokenizer, str(TEMPLATES / "llama3.jinja"))
    write = chat._Layout.write
    monkeypatch.setattr(chat._Layout, "write", lambda self, messages: (write(self, messages)[0] + " ", [0]))
    convs = conversations(4, 40)
    got = render.chats(convs, ["row"] * len(convs))
    assert [text for text, _ in got] == tokenizer.apply_chat_template(
        convs, tokenize=False, chat_template=render.template
    )
    assert render.chat._writes is True and render.chat._layouts is None


ODD = {
    # The last message is trimmed, the others not: a cut trims what the whole conversation keeps.
    "trims the last": (
        "{% for m in messages %}{{ m.role }}: {% if loop.last %}{{ m.content | trim }}{% else %}{{ m.content }}"
        "{% endif %}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
    ),
    # Different text around an empty content.
    "depends on the content": (
        "{% for m in messages %}{% if m.content %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% else %}"
        "<{{ m.role }}/>{% endif %}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
    ),
    # Content transformed beyond whitespace at its edges.
    "transforms the content": (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content | replace('\n', ' ') }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    ),
}


def _spans_or_refusal(fn, *args):
    try:
        return fn(*args)
    except ValueError as e:
        return str(e)


@pytest.mark.parametrize("name", list(ODD))
def test_conversations_no_layout_vouches_for_have_their_prefixes_rendered(tiny_world, tmp_path, name):
    template = tmp_path / "odd.jinja"
    template.write_text(ODD[name])
    render = _renderer(AutoTokenizer.from_pretrained(tiny_world["model"]), str(template))
    convs = conversations(1, 120, tool=False)
    _spans_or_refusal(render.chats, convs[:8], ["first batch"] * 8)
    vouched = outcomes = 0
    for c in convs:
        text = render.chat.render([c], ["row"], False)
        want = _spans_or_refusal(render._rendered_spans, [c], ["row"], text)
        got = _spans_or_refusal(render.chats, [c], ["row"])
        assert (got if isinstance(got, str) else [spans for _, spans in got]) == want
        vouched += render.chat.cut_lengths([c], text, [_cuts(c)])[0] is not None
        outcomes += isinstance(want, str)
    assert vouched < len(convs)  # the fallback was exercised
    if name == "trims the last":
        assert 0 < outcomes < len(convs)  # refused where a trimmed content differs, spans where not


def test_the_first_conversations_turn_off_layouts_that_disagree_with_their_prefixes(tiny_world, tmp_path):
    # The generation prompt depends on a content: no layout sees it, the rendered prefixes do.
    template = tmp_path / "magic.jinja"
    template.write_text(
        "{% for m in messages %}{{ m.role }}:{{ m.content }};{% endfor %}{% if add_generation_prompt %}"
        "{% if messages[-1].content == 'magic' %}!{% endif %}assistant:{% endif %}"
    )
    render = _renderer(AutoTokenizer.from_pretrained(tiny_world["model"]), str(template))
    magic = [{"role": "user", "content": "magic"}, {"role": "assistant", "content": "ok"}]
    plain = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    with pytest.raises(ValueError, match="row 1: .* does not render a conversation as the concatenation of its turns"):
        render.chats([plain, magic], ["row 0", "row 1"])
    assert render.chat._layouts is None
    fresh = _renderer(AutoTokenizer.from_pretrained(tiny_world["model"]), str(template))
    assert fresh.chats([plain], ["row 0"]) == [("user:hi;assistant:ok;", [(len("user:hi;assistant:"), 21)])]
    assert fresh.chat._layouts is not None


def test_the_batch_mask_is_each_examples_own(tiny_world):
    tokenizer = AutoTokenizer.from_pretrained(tiny_world["model"])
    render = _renderer(tokenizer, str(TEMPLATES / "llama3.jinja"))
    convs = conversations(2, 60)
    rendered = [(text, spans, False) for text, spans in render.chats(convs, ["row"] * len(convs))]
    rendered += [("### Instruction:\nhi\n\n### Response:\nhello", [(29, 34)], True), ("", [], True), ("x y", [], False)]
    encodings = tokenizer.backend_tokenizer.encode_batch([t for t, _, _ in rendered], add_special_tokens=False)
    tokens = TokenStarts(tokenizer.backend_tokenizer)
    table = masked_table(tokens, rendered, tokenizer.eos_token_id).to_pydict()
    eos = tokenizer.eos_token_id
    for (_, spans, add), enc, ids, trained in zip(rendered, encodings, table["ids"], table["trained"]):
        want = in_spans(np.asarray([s for s, _ in enc.offsets], dtype=np.int64), spans).tolist() + [True] * add
        assert ids == enc.ids + [eos] * add and trained == [int(t) for t in want]
    assert 0 < sum(map(sum, table["trained"])) < sum(map(len, table["trained"]))


def _pairs(seed: int, count: int) -> list[dict]:
    """Preference rows: a conversation's head as the prompt, completions as a message list, a
    string, or several messages."""
    rng = random.Random(seed)
    rows = []
    for i, c in enumerate(conversations(seed, count, tool=False)):
        head = c[: max(1, next(k for k, m in enumerate(c) if m["role"] == "assistant"))]
        answer = {"role": "assistant", "content": rng.choice(CONTENTS) + "answer"}
        more = [answer, {"role": "user", "content": "and?"}, {"role": "assistant", "content": "more"}]
        chosen = [[answer], answer["content"], more][i % 3]
        rows.append({"prompt": head, "chosen": chosen, "rejected": rng.choice(CONTENTS) + "other"})
    return rows


@pytest.mark.parametrize("template", ["chatml", "llama3", "own"])
def test_chat_pairs_split_as_their_rendered_prompt_does(tiny_world, template):
    tokenizer, path = _tokenizer_and_template(tiny_world, template)
    data = DataConfig(source="unused.jsonl", format="preference", chat_template=path, block_size=1024)
    columns = {"prompt": "prompt", "chosen": "chosen", "rejected": "rejected"}
    rows = _pairs(3, 150) + [{"prompt": "How?", "chosen": " yes", "rejected": " no"}]
    batch = {k: [r[k] for r in rows] for k in columns}
    fast, slow = PairEncoder(data, tokenizer, columns, "src"), PairEncoder(data, tokenizer, columns, "src")
    slow.chat._layouts = None  # every pair's prompt rendered on its own
    got = fast(batch, list(range(len(rows)))).to_pydict()
    assert got == slow(batch, list(range(len(rows)))).to_pydict()
    assert fast.chat._layouts  # the layouts were used
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    assert got["prompt"][-1] == bos + tokenizer("How?", add_special_tokens=False)["input_ids"]
    assert got["chosen"][-1][-1] == got["rejected"][-1][-1] == tokenizer.eos_token_id


def _pair_dataset(rows: list[dict], chosen_as_list: bool):
    """``rows`` as an Arrow-backed dataset of message lists (columns of one type each): chosen a
    message list and rejected a string, or the other way round."""
    from datasets import Dataset

    def messages(value):
        return value if isinstance(value, list) else [{"role": "assistant", "content": value}]

    def text(value):
        return value if isinstance(value, str) else "".join(m["content"] for m in value)

    return Dataset.from_list(
        [
            {
                "prompt": r["prompt"],
                "chosen": messages(r["chosen"]) if chosen_as_list else text(r["chosen"]),
                "rejected": text(r["rejected"]) if chosen_as_list else messages(r["rejected"]),
            }
            for r in rows
        ]
    )


@pytest.mark.parametrize("template", ["chatml", "llama3", "own"])
@pytest.mark.parametrize("chosen_as_list", [True, False])
def test_chat_pairs_read_as_flat_columns_split_as_their_rendered_prompt_does(tiny_world, template, chosen_as_list):
    tokenizer, path = _tokenizer_and_template(tiny_world, template)
    data = DataConfig(source="unused.jsonl", format="preference", chat_template=path, block_size=1024)
    columns = {"prompt": "prompt", "chosen": "chosen", "rejected": "rejected"}
    dataset = _pair_dataset(_pairs(5, 300), chosen_as_list)
    fast, slow = PairEncoder(data, tokenizer, columns, "src"), PairEncoder(data, tokenizer, columns, "src")
    slow.chat._layouts = None  # every pair's prompt rendered on its own, from Python rows
    got = fast.encode_dataset(dataset).to_pydict()
    assert got == slow(dataset.to_dict(), list(range(len(dataset)))).to_pydict()
    assert fast.chat._pairs_probed and fast.chat._layouts  # written from layouts, probed, kept on


def test_flat_pairs_written_unlike_their_renderings_turn_layouts_off(tiny_world, monkeypatch):
    from neuron_parallel import chat

    tokenizer = AutoTokenizer.from_pretrained(tiny_world["model"])
    data = DataConfig(source="unused.jsonl", format="preference", chat_template=str(TEMPLATES / "llama3.jinja"))
    columns = {"prompt": "prompt", "chosen": "chosen", "rejected": "rejected"}
    dataset = _pair_dataset(_pairs(6, 60), True)
    slow = PairEncoder(data, tokenizer, columns, "src")
    slow.chat._layouts = None
    want = slow(dataset.to_dict(), list(range(len(dataset)))).to_pydict()
    parts = chat._Layout.parts
    monkeypatch.setattr(chat._Layout, "parts", lambda self, contents, start=0: [*parts(self, contents, start), "!"])
    fast = PairEncoder(data, tokenizer, columns, "src")
    assert fast.encode_dataset(dataset).to_pydict() == want
    assert fast.chat._pairs_probed and fast.chat._layouts is None


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (lambda r: r["prompt"].append({"role": "narrator", "content": "x"}), "role 'narrator'"),
        (lambda r: r.update(chosen=""), "chosen completion"),
        (lambda r: r.update(rejected=[]), "rejected completion"),
        (lambda r: r["prompt"][0].update(content=None), "string content"),
    ],
)
def test_flat_pairs_with_a_fault_are_refused_by_row(tiny_world, change, needle):
    tokenizer = AutoTokenizer.from_pretrained(tiny_world["model"])
    data = DataConfig(source="unused.jsonl", format="preference", chat_template=str(TEMPLATES / "llama3.jinja"))
    rows = _pair_dataset(_pairs(7, 200), False).to_list()  # rejected a message list
    change(rows[150])
    dataset = _pair_dataset(rows, False)
    encoder = PairEncoder(data, tokenizer, {"prompt": "prompt", "chosen": "chosen", "rejected": "rejected"}, "src")
    with pytest.raises(ValueError, match="src row 150") as refused:
        encoder.encode_dataset(dataset)
    assert needle in str(refused.value)


def _chat_dataset(convs: list[list[dict]]):
    from datasets import Dataset

    return Dataset.from_list([{"messages": c} for c in convs])


@pytest.mark.parametrize("template", ["chatml", "llama3", "own"])
@pytest.mark.parametrize("train_on_prompt", [False, True])
def test_conversations_read_as_flat_columns_encode_as_their_renderings_do(tiny_world, template, train_on_prompt):
    tokenizer, path = _tokenizer_and_template(tiny_world, template)
    data = DataConfig(
        source="unused.jsonl", format="chat", chat_template=path, block_size=1024, train_on_prompt=train_on_prompt
    )
    dataset = _chat_dataset(conversations(8, 300))
    fast, slow = (
        Encoder(data, tokenizer, {"messages": "messages"}, "src"),
        Encoder(data, tokenizer, {"messages": "messages"}, "src"),
    )
    slow.render.chat._layouts = None  # every conversation rendered, its spans from its rendered prefixes
    got = fast.encode_dataset(dataset).to_pydict()
    assert got == slow(dataset.to_dict(), list(range(len(dataset)))).to_pydict()
    assert fast.render.chat._chat_plans and fast.render.chat._written_probed and fast.render.chat._layouts


def test_flat_conversations_written_unlike_their_renderings_turn_layouts_off(tiny_world, monkeypatch):
    from neuron_parallel import chat

    tokenizer = AutoTokenizer.from_pretrained(tiny_world["model"])
    data = DataConfig(source="unused.jsonl", format="chat", chat_template=str(TEMPLATES / "llama3.jinja"))
    dataset = _chat_dataset(conversations(9, 60))
    slow = Encoder(data, tokenizer, {"messages": "messages"}, "src")
    slow.render.chat._layouts = None
    want = slow(dataset.to_dict(), list(range(len(dataset)))).to_pydict()
    parts = chat._Layout.parts
    monkeypatch.setattr(chat._Layout, "parts", lambda self, contents, start=0: [*parts(self, contents, start), "!"])
    fast = Encoder(data, tokenizer, {"messages": "messages"}, "src")
    assert fast.encode_dataset(dataset).to_pydict() == want
    assert fast.render.chat._chat_plans and fast.render.chat._layouts is None


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (lambda c: c.append({"role": "narrator", "content": "x"}), "role 'narrator'"),
        (lambda c: c.clear(), "conversation is empty"),
        (lambda c: c[0].update(content=None), "string content"),
    ],
)
def test_flat_conversations_with_a_fault_are_refused_by_row(tiny_world, change, needle):
    tokenizer = AutoTokenizer.from_pretrained(tiny_world["model"])
    data = DataConfig(source="unused.jsonl", format="chat", chat_template=str(TEMPLATES / "llama3.jinja"))
    convs = conversations(10, 200)
    change(convs[150])
    encoder = Encoder(data, tokenizer, {"messages": "messages"}, "src")
    with pytest.raises(ValueError, match="src row 150") as refused:
        encoder.encode_dataset(_chat_dataset(convs))
    assert needle in str(refused.value)
