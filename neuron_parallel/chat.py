"""Chat rendering: conversations through a chat template compiled once, and where in the rendering
of a whole conversation the rendering of its first messages ends, found from that one rendering.

Chat SFT trains each assistant turn from the end of the rendering of the messages before it with
the generation prompt to the end of the rendering through it (``neuron_parallel.sft``); a
conversational preference pair splits prompt + completion after the prompt rendered with the
generation prompt (``neuron_parallel.preference``). Both need the length of such a *cut* (the
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
"""

from __future__ import annotations

import re
from itertools import accumulate

MARK = "\ue000{}\ue001"
MARKS = re.compile("\ue000([0-9]+)\ue001")
PAD = "\n \t"
EDGES = (None, str.strip, str.lstrip, str.rstrip)
"""What a template may do to the edges of a content: keep them, or strip whitespace (both, left, right)."""
PROBE = 8
"""Conversations of the first batch rendered the slow way as well, to check the compiled template's
renderings and the layouts' cuts."""
MAX_LAYOUTS = 4096


class ChatRenderer:
    """Renders conversations with ``template`` (``tokenizer.apply_chat_template``'s variables) and
    locates cuts in those renderings (see the module docstring). Picklable for ``num_proc``
    before first use."""

    def __init__(self, tokenizer, template: str, name: str) -> None:
        self.tokenizer, self.template, self.name = tokenizer, template, name
        self._compiled = None  # the fast path: None untried, False unavailable (see _render_fast)
        self._layouts: dict | None = {}  # None: layouts turned off (the probe found a difference)
        self._probed = False

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
        if self._compiled is False:
            return None
        if self._compiled is None:
            try:
                from transformers.utils.chat_template_utils import _compile_jinja_template

                self._compiled = _compile_jinja_template(self.template)
            except Exception:
                self._compiled = False
                return None
            probe = conversations[:PROBE]
            try:
                slow = self.tokenizer.apply_chat_template(probe, **self._template_kw(generation))
                same = slow == self._fast(probe, generation)
            except Exception:
                same = False
            if not same:
                self._compiled = False
                return None
        try:
            return self._fast(conversations, generation)
        except Exception:
            return None  # the slow path renders them again and names a refused row

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

    def split_pairs(self, pairs: list[tuple[list, list, list]], wheres: list[str]) -> list[tuple[str, str, str]]:
        """Each ``(prompt, chosen, rejected)`` message lists as ``(the prompt rendered with the
        generation prompt, what rendering prompt + chosen adds to it, what prompt + rejected
        adds)``: prompt + chosen and prompt + rejected rendered once each and split where the
        prompt's rendering ends. That length is found in prompt + chosen (:meth:`cut_lengths`;
        else the prompt is rendered); it depends on the prompt alone, so it holds for prompt +
        rejected when that starts with the same text. ValueError where a completion adds nothing
        or the prompt's rendering is not a prefix."""
        conversations = [prompt + turns for prompt, chosen, rejected in pairs for turns in (chosen, rejected)]
        full = self.render(conversations, [where for where in wheres for _ in range(2)], False)
        found = self.cut_lengths(conversations[::2], full[::2], [[(len(prompt), True)] for prompt, _, _ in pairs])
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

    def lengths(self, messages: list[dict], text: str) -> list[int] | None:
        """Each cut's length in ``text``, the rendering of ``messages`` (None: it is not this
        layout's text with the contents in place)."""
        parts = []
        for literal, i, edge in zip(self.literals, self.order, self.edges):
            content = messages[i]["content"]
            parts.append(literal)
            parts.append(content if edge is None else edge(content))
        parts.append(self.literals[-1])
        if "".join(parts) != text:
            return None
        ends = list(accumulate(map(len, parts)))
        return [(ends[2 * q - 1] if q else 0) + o for q, o in self.cuts]


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
