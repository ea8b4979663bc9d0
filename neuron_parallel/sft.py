"""How each example of chat, instruction and prompt/completion data becomes tokens, and which of
them carry loss.

Every example is rendered to one string plus the character spans that are trained; the string is
tokenized once (``add_special_tokens=False``; where each token starts, from
``neuron_parallel.token_starts``) and a token is trained when ``data.train_on_prompt`` is set or
its first character lies in a trained span. Formats:

- ``chat``: ``tokenizer.apply_chat_template`` with ``data.chat_template``'s text, or else the
  tokenizer's own. Assistant turn k spans from the end of the rendering of the turns before it with
  the generation prompt to the end of the rendering up to and including it, so every assistant
  turn of a multi-turn conversation is trained (its end marker included) and every system, user
  and tool turn is masked. A template for which those renderings are not prefixes of one another
  is refused. Where they end is read from the one rendering of the whole conversation when its
  layout vouches for that (``neuron_parallel.chat``); otherwise they are rendered. With a template
  that only writes its contents (the shipped ones), that rendering is written from the layout;
  conversations of messages with only a role and a content are read from Arrow as flat columns
  for that (``Encoder._flat``).
- ``instruction``: with a chat template (``data.chat_template`` or the tokenizer's), a two-turn
  chat: user = instruction, plus two newlines and the input when it is not empty; assistant =
  response. Without one, the plain prompt ``### Instruction:\\n{instruction}\\n\\n### Input:\\n
  {input}\\n\\n### Response:\\n`` (no Input section when the input is empty), then the response
  and EOS; loss on the response and EOS.
- ``prompt_completion``: prompt + completion + EOS; loss on the completion and EOS.
- ``text``: each document + EOS, every token trained.

Over-long examples (applied when rows are built, ``neuron_parallel.packing``): an example longer
than ``data.block_size`` is truncated to it (the tail is dropped) and counted as truncated; an
example then left with no token to predict is dropped and counted as dropped. In document mode a
text document longer than a row is instead cut into ``block_size`` pieces, each its own document.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from .chat import ChatRenderer, assistant_cuts
from .config import DataConfig
from .token_starts import TokenStarts, encode_ids, id_lists, overlapped
from .utils import gc_paused

ROLES = ("system", "user", "assistant", "tool")
ALPACA = ("instruction", "input", "output")
DOLLY = ("instruction", "context", "response")


def chat_template(data: DataConfig, tokenizer) -> str | None:
    """The chat template in use: ``data.chat_template``'s text, else the tokenizer's, else None."""
    if data.chat_template is not None:
        return Path(data.chat_template).expanduser().read_text()
    own = getattr(tokenizer, "chat_template", None)
    if isinstance(own, dict):  # named templates: the default one renders conversations
        own = own.get("default")
    return own or None


def resolve_columns(data: DataConfig, columns: list[str], where: str) -> dict[str, str | None]:
    """The columns each format reads, by role (``text``, ``messages``, ``prompt``, ``input``,
    ``response``), auto-detected where the config leaves them unset. Raises ValueError naming the
    columns found and the field that picks another."""

    def need(name: str | None, key: str, default: str) -> str:
        if name not in columns:
            raise ValueError(
                f"data.format={data.format}: {where} has no {default} column {name!r}; columns: {columns}; "
                f"set data.{key} to one of them"
            )
        return name

    if data.format == "text":
        if data.text_field not in columns:
            raise ValueError(
                f"data.text_field={data.text_field!r} is not a column of {where}; columns: {columns}"
                "; set data.text_field (or data.format for chat or instruction data)"
            )
        return {"text": data.text_field}
    if data.format == "chat":
        return {"messages": need(data.messages_field, "messages_field", "messages")}
    if data.format == "prompt_completion":
        return {
            "prompt": need(data.prompt_field or "prompt", "prompt_field", "prompt"),
            "response": need(data.response_field or "completion", "response_field", "completion"),
        }
    response = data.response_field or next((c for c in (ALPACA[2], DOLLY[2]) if c in columns), "output")
    context = data.input_field or next((c for c in (ALPACA[1], DOLLY[1]) if c in columns), None)
    return {
        "prompt": need(data.prompt_field or "instruction", "prompt_field", "instruction"),
        "input": None if context is None else need(context, "input_field", "input"),
        "response": need(response, "response_field", "response (output or response)"),
    }


_MESSAGES_FIX = "each row needs a non-empty list of {role, content} with a role in " + ", ".join(ROLES)


def check_messages(messages: Any, where: str) -> list[dict]:
    """``messages`` as a list of ``{role, content}``, or a ValueError naming the row, the problem and
    the fix."""
    if type(messages) is list and messages:  # the common case, checked in one cheaper pass
        for m in messages:
            if type(m) is not dict or m.get("role") not in ROLES or type(m.get("content")) is not str:
                break
            if None in m.values():
                break
        else:
            return messages
    fix = _MESSAGES_FIX
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: the conversation is {'empty' if messages in ([], None) else 'not a list'}; {fix}")
    out = []
    for j, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or not isinstance(m.get("content"), str):
            raise ValueError(f"{where}: message {j} is not a dict with a role and a string content ({m!r:.80}); {fix}")
        if m["role"] not in ROLES:
            raise ValueError(f"{where}: message {j} has role {m['role']!r}; {fix}")
        # Fields left None (other rows' fields, in Arrow's struct) are dropped; a message without any is kept as is.
        out.append(m if None not in m.values() else {k: v for k, v in m.items() if v is not None})
    return out


class Renderer:
    """Renders one example of ``data.format`` to ``(text, trained character spans, append EOS)``."""

    def __init__(self, data: DataConfig, tokenizer, columns: dict[str, str | None], template: str | None) -> None:
        self.data, self.tokenizer, self.columns, self.template = data, tokenizer, columns, template
        self.name = data.chat_template or f"the chat template of the tokenizer {tokenizer.name_or_path}"
        self.chat = ChatRenderer(tokenizer, template, self.name) if template is not None else None

    def chats(self, conversations: list[list[dict]], wheres: list[str]) -> list[tuple[str, list[tuple[int, int]]]]:
        """Each rendered conversation and the span of every assistant turn (see the module
        docstring): each conversation rendered once (or written from its layout), its spans read
        from that where its layout vouches for them (``neuron_parallel.chat``), else from its
        prefixes rendered."""
        if not conversations:
            return []
        if self.data.train_on_prompt:
            return [(text, [(0, len(text))]) for text in self.chat.render(conversations, wheres, False)]
        cuts = [assistant_cuts([m["role"] for m in c]) for c in conversations]
        spans: list = [None] * len(conversations)
        full, found = self.chat.render_cuts(conversations, wheres, cuts)
        for i, lengths in enumerate(found):
            spans[i] = None if lengths is None else _spans(lengths)
        slow = [i for i, s in enumerate(spans) if s is None]
        if slow:
            found = self._rendered_spans(
                [conversations[i] for i in slow], [wheres[i] for i in slow], [full[i] for i in slow]
            )
            for i, s in zip(slow, found):
                spans[i] = s
        return list(zip(full, spans))

    def flat_chats(self, flat, wheres: list[str]) -> list:
        """:meth:`chats` of conversations given as flat columns (``chat.Flat``), each written from
        its layout (``ChatRenderer.write_flat``), as ``(text, spans, False)`` (a rendered row of
        :meth:`batch`); None for a conversation not written so, or whose spans the layout does not
        vouch for: the caller passes it to :meth:`batch`."""
        whole = self.data.train_on_prompt
        out: list = []
        for written in self.chat.write_flat(flat, wheres, not whole):
            spans = None if written is None else [(0, len(written[0]))] if whole else _spans(written[1])
            out.append(None if spans is None else (written[0], spans, False))
        return out

    def _rendered_spans(
        self, conversations: list[list[dict]], wheres: list[str], full: list[str]
    ) -> list[list[tuple[int, int]]]:
        """The assistant spans of ``conversations`` (rendered as ``full``) by the definition: for
        each assistant turn k the first k messages with the generation prompt and the first k + 1,
        rendered in two batched calls; ValueError for a template for which they are not prefixes."""
        turns = [(i, k) for i, c in enumerate(conversations) for k, m in enumerate(c) if m["role"] == "assistant"]
        before = self.chat.render([conversations[i][:k] for i, k in turns], [wheres[i] for i, _ in turns], True)
        # The first k + 1 messages of a conversation that ends there are the whole conversation.
        partial = [(i, k) for i, k in turns if k + 1 < len(conversations[i])]
        through_k = [conversations[i][: k + 1] for i, k in partial]
        upto = dict(zip(partial, self.chat.render(through_k, [wheres[i] for i, _ in partial], False)))
        spans: list[list[tuple[int, int]]] = [[] for _ in conversations]
        for (i, k), head in zip(turns, before):
            through = upto.get((i, k), full[i])
            if not (through.startswith(head) and full[i].startswith(through)):
                raise ValueError(
                    f"{wheres[i]}: {self.name} does not render a conversation as the concatenation of its turns (the "
                    f"rendering of the first {k} messages plus the generation prompt is not a prefix of the rendering "
                    f"of the first {k + 1}, or that of the whole), so the assistant turns cannot be located; use a "
                    "template that does (neuron_parallel/chat_templates/), or set data.train_on_prompt: true"
                )
            spans[i].append((len(head), len(through)))
        return spans

    def batch(self, rows: list[dict], wheres: list[str]) -> list[tuple[str, list[tuple[int, int]], bool]]:
        """Every row rendered: ``(text, trained character spans, append EOS)``."""
        out: list = [None] * len(rows)
        chats: list[tuple[int, list[dict]]] = []
        for j, (row, where) in enumerate(zip(rows, wheres)):
            rendered = self._one(row, where)
            if isinstance(rendered, list):
                chats.append((j, rendered))
            else:
                out[j] = rendered
        results = self.chats([c for _, c in chats], [wheres[j] for j, _ in chats])
        for (j, _), (text, spans) in zip(chats, results):
            out[j] = (text, spans, False)
        return out

    def _one(self, row: dict, where: str) -> list[dict] | tuple[str, list[tuple[int, int]], bool]:
        """A conversation to render (chat, or instruction with a template), or the rendered row."""
        c = self.columns
        if self.data.format == "chat":
            return check_messages(row[c["messages"]], where)
        prompt, response = _string(row, c["prompt"], where), _string(row, c["response"], where)
        if self.data.format == "prompt_completion":
            return prompt + response, [(0 if self.data.train_on_prompt else len(prompt), len(prompt + response))], True
        context = _string(row, c["input"], where) if c["input"] else ""
        if self.template is not None:
            user = prompt + ("\n\n" + context if context else "")
            return [{"role": "user", "content": user}, {"role": "assistant", "content": response}]
        head = f"### Instruction:\n{prompt}\n\n" + (f"### Input:\n{context}\n\n" if context else "") + "### Response:\n"
        return head + response, [(0 if self.data.train_on_prompt else len(head), len(head + response))], True


def _spans(lengths: list[int]) -> list[tuple[int, int]] | None:
    """The assistant spans bounded by a conversation's cut lengths (``chat.assistant_cuts``), or
    None where one would end before it starts."""
    spans = list(zip(lengths[::2], lengths[1::2]))
    return spans if all(a <= b for a, b in spans) else None


def _string(row: dict, column: str, where: str) -> str:
    value = row[column]
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ValueError(f"{where}: column {column!r} holds {type(value).__name__}, not text; fix the data")
    return value


class Encoder:
    """The batched ``datasets.map`` function of one source: ``{"ids", "trained"}`` per example
    (``trained`` is 1 where the token carries loss as a target; text, which trains every token,
    has no ``trained``), as Arrow list columns for the formats that mask (:func:`masked_table`).
    Picklable for ``num_proc``."""

    def __init__(self, data: DataConfig, tokenizer, columns: dict[str, str | None], where: str) -> None:
        self.data, self.tokenizer, self.columns, self.where = data, tokenizer, columns, where
        self.eos = tokenizer.eos_token_id
        template = chat_template(data, tokenizer)
        if data.format == "chat" and template is None:
            raise ValueError(
                f"data.format=chat needs a chat template, but the tokenizer in {tokenizer.name_or_path} has none; "
                "set data.chat_template: path/to/template.jinja (e.g. neuron_parallel/chat_templates/chatml.jinja or "
                "llama3.jinja, whichever matches the model's special tokens)"
            )
        if data.format != "text" and not tokenizer.is_fast:
            raise ValueError(
                f"data.format={data.format} needs a fast tokenizer (character offsets locate the trained tokens); "
                f"the tokenizer in {tokenizer.name_or_path} is a slow one: save it with tokenizer.json"
            )
        self.render = Renderer(data, tokenizer, columns, template) if data.format != "text" else None
        # Ids and token starts straight from the Rust tokenizer (what the fast tokenizer's
        # __call__ runs), without turning every field of its encodings into Python lists.
        self.tokens = TokenStarts(tokenizer.backend_tokenizer) if self.render is not None else None

    def __call__(self, batch: dict[str, list], indices: list[int]):
        """``datasets.map``'s batched function: a batch of Python column lists."""
        with gc_paused():
            return self._encode(partial(batch_piece, batch), indices)

    def encode_dataset(self, dataset):
        """Every row of ``dataset``, the columns this format reads formatted as Python a piece at a
        time (:func:`dataset_piece`), as the piece is prepared; conversations whose messages are
        role and content only stay Arrow (:meth:`_flat`)."""
        with gc_paused():
            columns = dataset.select_columns([c for c in self.columns.values() if c is not None])
            piece = partial(dataset_piece, columns)
            if self.data.format == "chat" and plain_chat(
                columns.data.schema.field(self.columns["messages"]).type, False
            ):
                piece = partial(arrow_piece, columns.with_format("arrow"))
            return self._encode(piece, range(len(dataset)))

    def _encode(self, piece, indices):
        """``piece(a, b)``: rows ``a`` to ``b`` as Python column lists; ``indices``: their row numbers."""
        import pyarrow as pa

        backend = self.tokenizer.backend_tokenizer if self.tokenizer.is_fast else None
        if self.render is None:
            text = self.columns["text"]
            if backend is None:
                ids = self.tokenizer(piece(0, len(indices))[text], add_special_tokens=False)["input_ids"]
                return pa.table({"ids": pa.array([x + [self.eos] for x in ids], pa.list_(pa.int32()))})
            tables = overlapped(
                len(indices),
                lambda a, b: piece(a, b)[text],
                partial(encode_ids, backend),
                lambda _, encodings: pa.table({"ids": id_lists(encodings, self.eos, None, end=True)}),
            )
            return pa.concat_tables(tables)

        def prepare(a: int, b: int):
            columns = piece(a, b)
            wheres = [f"{self.where} row {indices[i]}" for i in range(a, b)]
            if not isinstance(columns, dict):  # an Arrow table of plain conversations
                return self._flat(columns, wheres)
            rows = [dict(zip(columns, values)) for values in zip(*columns.values())]
            return self.render.batch(rows, wheres)

        tables = overlapped(
            len(indices),
            prepare,
            lambda rendered: self.tokens.tokenize([text for text, _, _ in rendered]),
            lambda rendered, encodings: masked_table(self.tokens, rendered, self.eos, encodings),
        )
        return pa.concat_tables(tables)

    def _flat(self, table, wheres: list[str]) -> list:
        """The rendered rows (:meth:`Renderer.batch`) of an Arrow piece of conversations whose
        messages are role and content only, read as flat columns (``Renderer.flat_chats``): no
        dictionary per message, no check per message (Arrow's are per column). A piece with a
        missing or empty value or an unknown role, and the conversations not written from layouts,
        go to :meth:`Renderer.batch`, which names a refusal."""
        flat = flat_messages(table.column(self.columns["messages"]))
        rendered = self.render.flat_chats(flat, wheres) if flat is not None else [None] * len(wheres)
        rest = [j for j, r in enumerate(rendered) if r is None]
        if rest:
            done = self.render.batch(table.take(rest).to_pylist(), [wheres[j] for j in rest])
            for j, r in zip(rest, done):
                rendered[j] = r
        return rendered


def batch_piece(batch: dict[str, list], a: int, b: int) -> dict[str, list]:
    """Rows ``a`` to ``b`` of a batch of Python column lists."""
    return {k: v[a:b] for k, v in batch.items()}


def dataset_piece(dataset, a: int, b: int) -> dict[str, list]:
    """Rows ``a`` to ``b`` of a ``datasets.Dataset`` as Python column lists, as ``datasets`` formats
    them (a JSON column decoded, say). Formatting a whole source at once held every row as Python
    objects before the tokenizer started (on the tokenization benchmark's chat source, 19 ms with
    the tokenizer idle, against 9 ms for all its pieces), and several times the source's size in
    memory."""
    return dataset[a:b]


def masked_table(
    tokens: TokenStarts, rendered: list[tuple[str, list[tuple[int, int]], bool]], eos: int, encodings=None
):
    """The ``ids`` and ``trained`` columns (Arrow lists) of examples ``rendered`` as ``(text,
    trained character spans, append EOS)``, tokenized by ``tokens`` (from ``encodings``, its
    ``tokenize`` of the texts, where given): a token is trained when its first character lies in
    one of its example's spans; an appended EOS always is. Built from flat arrays of the whole
    batch, in one search: each example's positions are counted after those of the examples before
    it, plus one, so that no position is shared."""
    import pyarrow as pa

    texts, char_spans = [text for text, _, _ in rendered], [ex for _, ex, _ in rendered]
    encoded = tokens.starts(texts, char_spans, tokens.tokenize(texts) if encodings is None else encodings)
    flat, counts, starts, lengths, unit_spans = encoded
    base = np.cumsum(lengths + 1) - (lengths + 1)
    spans = [(a + b, e + b) for ex, b in zip(unit_spans, base.tolist()) for a, e in ex]
    trained = in_spans(starts + np.repeat(base, counts), spans)
    with_eos = np.fromiter((e for _, _, e in rendered), dtype=bool, count=len(rendered))
    if with_eos.any():
        at = np.cumsum(counts)[with_eos]
        flat, trained = np.insert(flat, at, eos), np.insert(trained, at, True)
        counts = counts + with_eos
    offsets = pa.array(np.concatenate([[0], np.cumsum(counts)]).astype(np.int32))
    return pa.table(
        {
            "ids": pa.ListArray.from_arrays(offsets, pa.array(flat)),
            "trained": pa.ListArray.from_arrays(offsets, pa.array(trained.astype(np.int8))),
        }
    )


def in_spans(starts: np.ndarray, spans: list[tuple[int, int]]) -> np.ndarray:
    """Whether each character offset in ``starts`` lies in one of the sorted, disjoint ``spans``."""
    if not spans:
        return np.zeros(len(starts), dtype=bool)
    lo = np.asarray([s for s, _ in spans])
    hi = np.asarray([e for _, e in spans])
    k = np.searchsorted(lo, starts, side="right") - 1
    return (k >= 0) & (starts < hi[np.maximum(k, 0)])


def arrow_piece(dataset, a: int, b: int):
    """Rows ``a`` to ``b`` of a ``datasets.Dataset`` in Arrow format, as a ``pyarrow.Table``."""
    return dataset[a:b]


def plain_chat(kind, completion: bool) -> bool:
    """Whether Arrow type ``kind`` is a list of messages of a string role and content and nothing
    else (or, for a ``completion``, a string)."""
    import pyarrow as pa

    if completion and pa.types.is_string(kind):
        return True
    if not pa.types.is_list(kind) or not pa.types.is_struct(kind.value_type):
        return False
    fields = {f.name: f.type for f in kind.value_type}
    return set(fields) == {"role", "content"} and all(pa.types.is_string(t) for t in fields.values())


def flat_messages(column):
    """A column of :func:`plain_chat` values as ``chat.Flat`` (a string: one assistant message),
    or None where a value or message is missing, a value is empty, or a role is not one of
    ``sft.ROLES``."""
    import pyarrow as pa
    import pyarrow.compute as pc

    column = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    n = len(column)
    if column.null_count:
        return None
    if pa.types.is_string(column.type):
        if n and pc.min(pc.utf8_length(column)).as_py() == 0:
            return None
        return ["assistant"] * n, column.to_pylist(), list(range(n + 1))
    if n and pc.min(pc.list_value_length(column)).as_py() == 0:
        return None
    messages = column.flatten()
    kind = messages.type
    role, content = (messages.flatten()[kind.get_field_index(name)] for name in ("role", "content"))
    if messages.null_count or role.null_count or content.null_count:
        return None
    if not pc.all(pc.is_in(role, value_set=pa.array(ROLES))).as_py():
        return None
    offsets = column.offsets.to_numpy()
    return role.to_pylist(), content.to_pylist(), (offsets - offsets[0]).tolist()
