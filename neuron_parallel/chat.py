"""Chat rendering: conversations through a chat template compiled once, and where in the rendering
of a whole conversation the rendering of its first messages ends, found from that one rendering.

Chat SFT trains each assistant turn from the end of the rendering of the messages before it with
the generation prompt to the end of the rendering through it (``neuron_parallel.sft``); a
conversational preference pair splits prompt + completion after the prompt rendered with the
generation prompt (``neuron_parallel.pairs``). Both need the length of such a *cut* (the
first ``j`` messages, with or without the generation prompt) when it is a prefix of the rendering
of the whole conversation. Rendering every cut costs one template call each; instead, the *layout*
of a conversation's shape (the roles and other fields of its messages, and the cuts asked for) is
rendered once with each message's content replaced by a marker, and every conversation of that
shape is rendered once and read against it.

A layout renders the whole conversation and each cut twice: with bare markers ``\\ue000<i>\\ue001``
(the template's own text around the contents, exactly) and with the markers padded by whitespace
on both sides (what the template does to the edges of each content: keeps them, or strips
whitespace on either side). It is used only when, in both, each cut is a prefix of the whole that
ends outside every content. A conversation is read when its rendering is exactly the layout's text
with each marker replaced by its message's content, stripped as the padding was; each cut's length
is then the length of the text before its place. Otherwise (text that depends on the contents, a
content transformed otherwise, a field that cannot be a dictionary key) the answer is ``None`` and
the caller renders the cuts themselves. The cuts of the first conversations are also rendered and
compared; any difference turns layouts off for the renderer's life. What none of these checks
sees: a cut whose rendering depends on a content in a way the whole rendering does not show (a
generation prompt that depends on the last message's text, say) in a conversation after the
first ones (no shipped template does that).

A template whose source shows that it reads each content only to write it, as it is or trimmed
(:func:`writes_contents`), renders every conversation of one shape as that shape's layout with
the contents in place: such a conversation is written from its layout, and its cuts read from
it, without rendering it (the first conversations are rendered too, and compared). Conversations
and preference pairs of plain ``{role, content}`` messages come as flat columns of roles and
contents, without a dictionary per message: a conversation is written from the layout of its
roles (:meth:`ChatRenderer.write_flat`); a pair's prompt once, from the layout of prompt + chosen,
and only what prompt + rejected adds after it from that one's (:meth:`ChatRenderer.split_flat_pairs`).
"""

from __future__ import annotations

import re
from itertools import accumulate

from .chat_source import writes_contents

MARK = "\ue000{}\ue001"
MARKS = re.compile("\ue000([0-9]+)\ue001")
PAD = "\n \t"
EDGES = (None, str.strip, str.lstrip, str.rstrip)
"""What a template may do to the edges of a content: keep them, or strip whitespace (both, left, right)."""
PROBE = 8
"""Conversations of the first batch rendered the slow way as well, to check the compiled template's
renderings and the layouts' cuts."""
MAX_LAYOUTS = 4096
Flat = tuple[list[str], list[str], list[int]]
"""Messages of several conversations as flat columns: roles, contents, and each conversation's
first message (one more at the end: where the last one ends)."""


class ChatRenderer:
    """Renders conversations with ``template`` (``tokenizer.apply_chat_template``'s variables) and
    locates cuts in those renderings (see the module docstring). Picklable for ``num_proc``
    before first use."""

    def __init__(self, tokenizer, template: str, name: str) -> None:
        self.tokenizer, self.template, self.name = tokenizer, template, name
        self._compiled = None  # the fast path: None untried, False unavailable (see _render_fast)
        self._layouts: dict | None = {}  # None: layouts turned off (the probe found a difference)
        self._probed = False
        self._writes: bool | None = None  # writes_contents of the compiled template; None: not yet known
        self._written_probed = False  # conversations written from layouts were compared with renderings
        self._pair_plans: dict = {}  # split_flat_pairs: per (prompt, chosen, rejected) roles, its layouts or None
        self._chat_plans: dict = {}  # write_flat: per (roles, spans asked), the layout or None
        self._pairs_probed = False  # pairs written by split_flat_pairs were compared with renderings

    def render(self, conversations: list[list[dict]], wheres: list[str], generation: bool) -> list[str]:
        """Render ``conversations`` in one batch (the per-call work is paid once); when the
        template refuses one, render them one by one to name it (ValueError)."""
        if not conversations:
            return []
        fast = self._render_fast(conversations, generation) if all(conversations) else None
        if fast is not None:
            return fast
        kw = self._template_kw(generation)
        try:
            return self.tokenizer.apply_chat_template(conversations, **kw)
        except Exception:
            for conversation, where in zip(conversations, wheres):
                try:
                    self.tokenizer.apply_chat_template(conversation, **kw)
                except Exception as e:  # a template's own refusal (raise_exception) or a Jinja error
                    raise ValueError(f"{where}: {self.name} cannot render this conversation: {e}") from None
            raise

    def _render_fast(self, conversations: list[list[dict]], generation: bool) -> list[str] | None:
        """The template, compiled once by transformers' own compiler, rendered with the variables
        ``apply_chat_template`` gives it (messages, add_generation_prompt, the special tokens).
        ``apply_chat_template`` prepares every message for every call (most of its time on
        conversations of a few turns); these messages are already plain dicts of strings, which
        that preparation leaves as they are. Checked against ``apply_chat_template`` on the first
        batch: any difference, or a transformers without the compiler, keeps the slow path."""
        if not self._compile(conversations, generation):
            return None
        try:
            return self._fast(conversations, generation)
        except Exception:
            return None  # the slow path renders them again and names a refused row

    def _compile(self, conversations: list[list[dict]], generation: bool) -> bool:
        """Whether the compiled template is in use: compiled on the first call and checked against
        ``apply_chat_template`` on the first :data:`PROBE` of ``conversations``."""
        if self._compiled is None:
            try:
                from transformers.utils.chat_template_utils import _compile_jinja_template

                self._compiled = _compile_jinja_template(self.template)
            except Exception:
                self._compiled = False
                return False
            probe = conversations[:PROBE]
            try:
                slow = self.tokenizer.apply_chat_template(probe, **self._template_kw(generation))
                same = slow == self._fast(probe, generation)
            except Exception:
                same = False
            if not same:
                self._compiled = False
        return self._compiled is not False

    def _fast(self, conversations: list[list[dict]], generation: bool) -> list[str]:
        """What ``Template.render(messages=..., add_generation_prompt=..., **special tokens)``
        returns, with the template's globals merged into those variables once per batch rather
        than once per conversation (Jinja's ``render`` merges them from a ChainMap every call)."""
        template = self._compiled
        shared = {**template.globals, **self.tokenizer.special_tokens_map, "add_generation_prompt": generation}
        concat, root = template.environment.concat, template.root_render_func
        return [concat(root(template.new_context({**shared, "messages": c}, shared=True))) for c in conversations]

    def _render_one(self, messages: list[dict], generation: bool) -> str:
        """One rendering by the path :meth:`render` takes, exceptions raised as they come."""
        if messages and self._compiled:
            return self._fast([messages], generation)[0]
        # A batch of one: [] is a conversation.
        return self.tokenizer.apply_chat_template([messages], **self._template_kw(generation))[0]

    def _template_kw(self, generation: bool) -> dict:
        """``apply_chat_template``'s arguments for a rendering to text with this template."""
        return dict(tokenize=False, chat_template=self.template, add_generation_prompt=generation)

    def cut_lengths(
        self, conversations: list[list[dict]], texts: list[str], cuts: list[list[tuple[int, bool]]]
    ) -> list[list[int] | None]:
        """For each conversation, rendered (by :meth:`render`, without the generation prompt) as
        ``texts[i]``, and each cut ``(j, generation)`` of ``cuts[i]``: the length of the rendering
        of its first ``j`` messages (with the generation prompt when ``generation``), a prefix of
        ``texts[i]``; ``None`` for a conversation whose layout cannot vouch for that (the caller
        renders its cuts)."""
        out: list[list[int] | None] = [None] * len(conversations)
        if self._layouts is None:
            return out
        for i, (messages, text, want) in enumerate(zip(conversations, texts, cuts)):
            layout = self._layout(messages, want)
            if layout is not None:
                out[i] = layout.lengths(messages, text)
        if not self._probed:
            self._probed = True
            if not self._agrees(conversations[:PROBE], texts[:PROBE], cuts[:PROBE], out[:PROBE]):
                self._layouts = None
                return [None] * len(conversations)
        return out

    def render_cuts(
        self, conversations: list[list[dict]], wheres: list[str], cuts: list[list[tuple[int, bool]] | None]
    ) -> tuple[list[str], list[list[int] | None]]:
        """Each conversation rendered as :meth:`render` renders it without the generation prompt,
        and its :meth:`cut_lengths` for ``cuts[i]`` (``None`` cuts: none asked, the answer
        ``None``). Where the template :func:`writes_contents`, a conversation of a shape with a
        layout is written from the layout, cut lengths and all, without rendering it; the first
        batch's first conversations are rendered as well, and any difference turns layouts off."""
        if not conversations:
            return [], []
        texts: list = [None] * len(conversations)
        found: list = [None] * len(conversations)
        if self._layouts is not None and self._written(conversations):
            for i, (messages, want) in enumerate(zip(conversations, cuts)):
                layout = self._layout(messages, want or [])
                if layout is not None:
                    texts[i], lengths = layout.write(messages)
                    found[i] = lengths if want is not None else None
            agree = None if self._written_probed else self._written_agree(conversations, wheres, cuts, texts, found)
            if agree is False:
                self._layouts = None
                texts, found = [None] * len(conversations), [None] * len(conversations)
            self._written_probed = self._written_probed or agree is True
        rest = [i for i, text in enumerate(texts) if text is None]
        if rest:
            full = self.render([conversations[i] for i in rest], [wheres[i] for i in rest], False)
            asked = [(i, text) for i, text in zip(rest, full) if cuts[i] is not None]
            lengths = self.cut_lengths(
                [conversations[i] for i, _ in asked], [text for _, text in asked], [cuts[i] for i, _ in asked]
            )
            for i, text in zip(rest, full):
                texts[i] = text
            for (i, _), n in zip(asked, lengths):
                found[i] = n
        return texts, found

    def _written(self, conversations: list[list[dict]]) -> bool:
        """Whether conversations are written from layouts: the template compiles (checked on the
        first ``conversations``) and :func:`writes_contents`; decided on the first call."""
        if self._writes is None:
            compiled = all(conversations[:PROBE]) and self._compile(conversations, False)
            self._writes = compiled and writes_contents(self._compiled.environment, self.template)
        return self._writes

    def _written_agree(self, conversations, wheres, cuts, texts, found) -> bool | None:
        """Whether the first conversations written from layouts are their renderings, and the cut
        lengths found in them those of the cuts rendered (None: none of them was written)."""
        probe = [i for i, text in enumerate(texts[:PROBE]) if text is not None]
        if not probe:
            return None
        rendered = self.render([conversations[i] for i in probe], [wheres[i] for i in probe], False)
        if rendered != [texts[i] for i in probe]:
            return False
        asked = [i for i in probe if cuts[i] is not None]
        return self._agrees(
            [conversations[i] for i in asked],
            [texts[i] for i in asked],
            [cuts[i] for i in asked],
            [found[i] for i in asked],
        )

    def write_flat(self, flat: Flat, wheres: list[str], spans: bool) -> list:
        """:meth:`render_cuts` of conversations whose messages are plain ``{role, content}`` given
        as flat columns (``Flat``), for a template that :func:`writes_contents`: each conversation
        written from the layout of its roles, without a message dictionary per message, as ``(text,
        cut lengths)``, the cuts those of :func:`assistant_cuts` where ``spans``, none else. ``None``
        for a conversation without a layout: the caller renders it (:meth:`render_cuts`), which
        names a refusal. The first conversations written are also rendered and compared; any
        difference turns layouts off."""
        out: list = [None] * len(wheres)
        if self._layouts is None or not wheres:
            return out
        if self._writes is None:
            self._written([_messages(flat, i) for i in range(min(PROBE, len(wheres)))])
        if not self._writes:
            return out
        roles, contents, at = flat
        plans = self._chat_plans
        for i in range(len(wheres)):
            a, b = at[i], at[i + 1]
            key = (tuple(roles[a:b]), spans)
            layout = plans.get(key, False)
            if layout is False:
                if len(plans) >= MAX_LAYOUTS:
                    plans.clear()
                cuts = assistant_cuts(key[0]) if spans else []
                layout = plans[key] = self._layout([{"role": role, "content": ""} for role in key[0]], cuts)
            if layout is not None:
                out[i] = layout.write_contents(contents[a:b])
        if not self._written_probed:
            probe = [i for i in range(min(PROBE, len(wheres))) if out[i] is not None]
            if probe:
                conversations = [_messages(flat, i) for i in probe]
                cuts = [assistant_cuts(roles[at[i] : at[i + 1]]) if spans else [] for i in probe]
                texts, found = [out[i][0] for i in probe], [out[i][1] for i in probe]
                if not self._written_agree(conversations, [wheres[i] for i in probe], cuts, texts, found):
                    self._layouts = None
                    return [None] * len(wheres)
                self._written_probed = True
        return out

    def split_pairs(self, pairs: list[tuple[list, list, list]], wheres: list[str]) -> list[tuple[str, str, str]]:
        """Each ``(prompt, chosen, rejected)`` message lists as ``(the prompt rendered with the
        generation prompt, what rendering prompt + chosen adds to it, what prompt + rejected
        adds)``: prompt + chosen and prompt + rejected rendered once each and split where the
        prompt's rendering ends. That length is found in prompt + chosen (:meth:`cut_lengths`;
        else the prompt is rendered); it depends on the prompt alone, so it holds for prompt +
        rejected when that starts with the same text. ValueError where a completion adds nothing
        or the prompt's rendering is not a prefix."""
        conversations = [prompt + turns for prompt, chosen, rejected in pairs for turns in (chosen, rejected)]
        cuts = [want for prompt, _, _ in pairs for want in ([(len(prompt), True)], None)]
        full, found = self.render_cuts(conversations, [where for where in wheres for _ in range(2)], cuts)
        found = found[::2]
        out = []
        for k, ((prompt, _, _), where) in enumerate(zip(pairs, wheres)):
            a, b, cut = full[2 * k], full[2 * k + 1], found[k]
            n = cut[0] if cut is not None else None
            if n is not None and n < min(len(a), len(b)) and b.startswith(a[:n]):  # one prompt rendering, then more
                out.append((a[:n], a[n:], b[n:]))
                continue
            head = self.render([prompt], [where], True)[0]
            for role, text in (("chosen", a), ("rejected", b)):
                if not text.startswith(head) or len(text) == len(head):
                    raise ValueError(
                        f"{where}: the chat template does not render the {role} completion as an addition to the "
                        "prompt rendered with the generation prompt; use a template that does "
                        "(neuron_parallel/chat_templates/)"
                    )
            out.append((head, a[len(head) :], b[len(head) :]))
        return out

    def split_flat_pairs(self, prompts: Flat, chosen: Flat, rejected: Flat, wheres: list[str]) -> list:
        """:meth:`split_pairs` of pairs whose messages are plain ``{role, content}`` given as flat
        columns, ``(roles, contents, offsets)`` each (pair ``i``'s prompt is messages
        ``offsets[i]`` to ``offsets[i + 1]`` of the prompts', and so on), for a template that
        :func:`writes_contents`: each pair written from the layouts of prompt + chosen (cut after
        the prompt) and prompt + rejected, the prompt once, without a message dictionary per
        message or a second writing and search of the prompt. The two layouts are checked once,
        per shape, to write the same text before the cut. ``None`` for a pair not written so (no
        layouts, a completion that adds nothing): the caller passes it to :meth:`split_pairs`,
        which renders it and names a refusal. The first pairs written are also rendered and
        compared; any difference turns layouts off."""
        out: list = [None] * len(wheres)
        if self._layouts is None or not wheres:
            return out
        if self._writes is None:
            self._written([_messages(prompts, i) + _messages(chosen, i) for i in range(min(PROBE, len(wheres)))])
        if not self._writes:
            return out
        (p_roles, p_text, p_at), (c_roles, c_text, c_at), (r_roles, r_text, r_at) = prompts, chosen, rejected
        plans = self._pair_plans
        for i in range(len(wheres)):
            a, b, c, d, e, f = p_at[i], p_at[i + 1], c_at[i], c_at[i + 1], r_at[i], r_at[i + 1]
            key = (tuple(p_roles[a:b]), tuple(c_roles[c:d]), tuple(r_roles[e:f]))
            plan = plans.get(key, False)
            if plan is False:
                if len(plans) >= MAX_LAYOUTS:
                    plans.clear()
                plan = plans[key] = self._pair_plan(*key)
            if plan is None:
                continue
            chosen_layout, rejected_layout, q, o = plan
            contents = p_text[a:b]
            parts = chosen_layout.parts(contents + c_text[c:d])
            tail = rejected_layout.parts(contents + r_text[e:f], 2 * q)
            tail[0] = tail[0][o:]
            cut = parts[2 * q]
            pair = ("".join(parts[: 2 * q]) + cut[:o], cut[o:] + "".join(parts[2 * q + 1 :]), "".join(tail))
            if pair[1] and pair[2]:
                out[i] = pair
        if not self._pairs_probed:
            probe = [i for i, pair in enumerate(out[:PROBE]) if pair is not None]
            if probe:
                self._pairs_probed = True
                if not all(self._pair_agrees(prompts, chosen, rejected, i, out[i], wheres[i]) for i in probe):
                    self._layouts = None
                    return [None] * len(wheres)
        return out

    def _pair_plan(self, prompt: tuple, chosen: tuple, rejected: tuple):
        """``(layout of prompt + chosen with its cut after the prompt, layout of prompt + rejected,
        the cut's place)`` for pairs of these roles, or None: no layouts, or not the same text
        before that place in both (then prompt + rejected does not start with the prompt's
        rendering as prompt + chosen does)."""
        head = [{"role": role, "content": ""} for role in prompt]
        chosen_layout = self._layout(head + [{"role": role, "content": ""} for role in chosen], [(len(head), True)])
        rejected_layout = self._layout(head + [{"role": role, "content": ""} for role in rejected], [])
        if chosen_layout is None or rejected_layout is None:
            return None
        ((q, o),) = chosen_layout.cuts
        same = (
            q < len(rejected_layout.literals)
            and chosen_layout.order[:q] == rejected_layout.order[:q]
            and chosen_layout.edges[:q] == rejected_layout.edges[:q]
            and chosen_layout.literals[:q] == rejected_layout.literals[:q]
            and chosen_layout.literals[q][:o] == rejected_layout.literals[q][:o]
        )
        return (chosen_layout, rejected_layout, q, o) if same else None

    def _pair_agrees(self, prompts: Flat, chosen: Flat, rejected: Flat, i: int, pair: tuple, where: str) -> bool:
        """Whether pair ``i`` written as ``pair`` is the prompt rendered with the generation prompt
        and what rendering prompt + chosen and prompt + rejected adds to it."""
        prompt = _messages(prompts, i)
        try:
            head = self.render([prompt], [where], True)[0]
            full = self.render([prompt + _messages(chosen, i), prompt + _messages(rejected, i)], [where] * 2, False)
        except ValueError:
            return False
        return (head, full[0], full[1]) == (pair[0], pair[0] + pair[1], pair[0] + pair[2])

    def _layout(self, messages: list[dict], cuts: list[tuple[int, bool]]) -> _Layout | None:
        try:
            shape = tuple(
                m["role"] if len(m) == 2 else tuple(sorted((k, v) for k, v in m.items() if k != "content"))
                for m in messages
            )
            key = (shape, tuple(cuts))
            layout = self._layouts.get(key, False)
        except TypeError:  # a field that cannot be a key (a list, a dict): no layout
            return None
        if layout is False:
            if len(self._layouts) >= MAX_LAYOUTS:
                self._layouts.clear()
            layout = self._layouts[key] = _Layout.build(self._render_one, messages, cuts)
        return layout

    def _agrees(self, conversations, texts, cuts, got) -> bool:
        """Whether every cut length found equals the length of that cut rendered, a prefix."""
        for messages, text, want, lengths in zip(conversations, texts, cuts, got):
            if lengths is None:
                continue
            for (j, generation), n in zip(want, lengths):
                try:
                    head = self._render_one(messages[:j], generation)
                except Exception:
                    return False
                if len(head) != n or not text.startswith(head):
                    return False
        return True


class _Layout:
    """The template's text around the contents of one conversation shape, and each cut's place
    in it: ``literals[q]`` precedes the ``q``-th content written, that of message ``order[q]``
    with ``edges[q]`` applied; a cut ``(q, o)`` ends ``o`` characters into ``literals[q]``."""

    __slots__ = ("literals", "order", "edges", "cuts")

    def __init__(self, literals, order, edges, cuts) -> None:
        self.literals, self.order, self.edges, self.cuts = literals, order, edges, cuts

    @classmethod
    def build(cls, render, messages: list[dict], cuts: list[tuple[int, bool]]) -> _Layout | None:
        bare = [{**m, "content": MARK.format(i)} for i, m in enumerate(messages)]
        padded = [{**m, "content": PAD + MARK.format(i) + PAD} for i, m in enumerate(messages)]
        try:
            whole, whole_padded = render(bare, False), render(padded, False)
            heads = [(render(bare[:j], g), render(padded[:j], g)) for j, g in cuts]
        except Exception:  # the caller's own renderings name the refusal
            return None
        literals, order, starts, at = [], [], [], 0
        for found in MARKS.finditer(whole):
            i = int(found.group(1))
            if i >= len(messages):
                return None
            starts.append(at)
            literals.append(whole[at : found.start()])
            order.append(i)
            at = found.end()
        starts.append(at)
        literals.append(whole[at:])
        padded_starts = _padded_starts(whole_padded, literals, order)
        if padded_starts is None:
            return None
        edges, padded_starts = padded_starts
        places = []
        for head, head_padded in heads:
            if not (whole.startswith(head) and whole_padded.startswith(head_padded)):
                return None
            n = len(head)
            q = next((q for q, s in enumerate(starts) if s <= n <= s + len(literals[q])), None)
            if q is None or len(head_padded) != padded_starts[q] + n - starts[q]:
                return None  # inside a content, or not the same place in both renderings
            places.append((q, n - starts[q]))
        return cls(literals, order, edges, places)

    def _parts(self, messages: list[dict]) -> list[str]:
        """This layout's text with the contents of ``messages`` in place, as its pieces. (The loop
        of :meth:`parts`, reading each content from its message: a list of the contents first
        would cost every conversation one more pass.)"""
        parts = []
        for literal, i, edge in zip(self.literals, self.order, self.edges):
            content = messages[i]["content"]
            parts.append(literal)
            parts.append(content if edge is None else edge(content))
        parts.append(self.literals[-1])
        return parts

    def parts(self, contents: list[str], start: int = 0) -> list[str]:
        """This layout's text with the messages' ``contents`` in place, as its pieces (literals at
        even places), from piece ``start`` (even) on."""
        q = start // 2
        parts = []
        for literal, i, edge in zip(self.literals[q:], self.order[q:], self.edges[q:]):
            content = contents[i]
            parts.append(literal)
            parts.append(content if edge is None else edge(content))
        parts.append(self.literals[-1])
        return parts

    def _cut_lengths(self, parts: list[str]) -> list[int]:
        ends = list(accumulate(map(len, parts)))
        return [(ends[2 * q - 1] if q else 0) + o for q, o in self.cuts]

    def lengths(self, messages: list[dict], text: str) -> list[int] | None:
        """Each cut's length in ``text``, the rendering of ``messages`` (None: it is not this
        layout's text with the contents in place)."""
        parts = self._parts(messages)
        return self._cut_lengths(parts) if "".join(parts) == text else None

    def write(self, messages: list[dict]) -> tuple[str, list[int]]:
        """The rendering of ``messages`` and each cut's length in it, for a template that
        :func:`writes_contents`."""
        parts = self._parts(messages)
        return "".join(parts), self._cut_lengths(parts) if self.cuts else []

    def write_contents(self, contents: list[str]) -> tuple[str, list[int]]:
        """:meth:`write` of messages given as their ``contents``."""
        parts = self.parts(contents)
        return "".join(parts), self._cut_lengths(parts) if self.cuts else []


def _padded_starts(text: str, literals: list[str], order: list[int]):
    """Read the padded rendering ``text`` as ``literals`` around the padded markers: per marker,
    the one edge treatment that fits, and where each literal starts; None where none or more
    than one fits."""
    edges, starts, at = [], [], 0
    for q, i in enumerate(order):
        if not text.startswith(literals[q], at):
            return None
        starts.append(at)
        at += len(literals[q])
        marker = PAD + MARK.format(i) + PAD
        fits = [e for e in EDGES if text.startswith((marker if e is None else e(marker)) + literals[q + 1], at)]
        if len(fits) != 1:
            return None
        edges.append(fits[0])
        at += len(marker if fits[0] is None else fits[0](marker))
    starts.append(at)
    if text[at:] != literals[-1]:
        return None
    return edges, starts


def assistant_cuts(roles) -> list[tuple[int, bool]]:
    """The cuts that bound every assistant turn of a conversation of ``roles``: before it, with the
    generation prompt, and after it (``neuron_parallel.sft``'s spans)."""
    return [cut for k, role in enumerate(roles) if role == "assistant" for cut in ((k, True), (k + 1, False))]


def _messages(flat: Flat, i: int) -> list[dict]:
    """Conversation ``i`` of ``flat`` as message dictionaries."""
    roles, contents, at = flat
    return [{"role": r, "content": c} for r, c in zip(roles[at[i] : at[i + 1]], contents[at[i] : at[i + 1]])]
