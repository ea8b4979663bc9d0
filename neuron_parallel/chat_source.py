"""Reading a chat template's source: whether it reads each message's content only to write it
(:func:`writes_contents`), so that every conversation of one shape renders as that shape's layout
with the contents in place and can be written from it (``neuron_parallel.chat``)."""

from __future__ import annotations

CALLS = frozenset({"raise_exception", "namespace", "range", "dict"})
"""Functions a template may call and still have its conversations written from layouts: none of
them depends on anything but its arguments (``strftime_now`` reads the clock, ``lipsum`` draws)."""
FILTERS_OFF = frozenset({"random", "attr", "map", "select", "reject", "selectattr", "rejectattr"})
"""Jinja's filters left out: one draws, one reads an attribute named by a string, the others apply
filters and tests named by strings."""
LOOP_OFF = frozenset({"previtem", "nextitem", "cycle", "changed"})
"""What of a loop's ``loop`` is left out: the items before and after (messages), and its calls."""


def writes_contents(environment, source: str) -> bool:
    """Whether the template ``source`` reads each message's content only to write it, as it is or
    trimmed, so that its rendering of any conversation of one shape is that shape's layout with the
    contents in place. Read from its syntax tree: every content is a term of a ``{{ }}`` expression
    made of ``+`` and ``~`` (trimmed by a plain ``trim`` at most); ``messages`` is only looped over
    (whole or sliced), counted, or indexed by a constant, and a message only indexed by a constant
    key that is not a method; no test, loop condition, assignment or call sees a content; calls
    are to :data:`CALLS` only, filters and tests Jinja's own (less :data:`FILTERS_OFF`); no macro,
    block capture, include, import or extension node; the environment writes values as given (no
    autoescape, no finalize). Whatever else depends on the conversation depends on its shape (the
    roles and other fields, the layout's key). Anything it does not know answers False."""
    from jinja2 import nodes
    from jinja2.filters import FILTERS
    from jinja2.tests import TESTS

    if environment.autoescape is not False or environment.finalize is not None:
        return False
    try:
        tree = environment.parse(source)
    except Exception:
        return False
    allowed = (
        nodes.Template, nodes.Output, nodes.TemplateData, nodes.Const, nodes.Name, nodes.Getitem, nodes.Getattr,
        nodes.Slice, nodes.For, nodes.If, nodes.Assign, nodes.NSRef, nodes.Filter, nodes.Test, nodes.Compare,
        nodes.Operand, nodes.BinExpr, nodes.Concat, nodes.UnaryExpr, nodes.CondExpr, nodes.Call, nodes.Keyword,
        nodes.List, nodes.Tuple, nodes.Dict, nodes.Pair, nodes.Continue, nodes.Break,
    )  # fmt: skip
    parent: dict[int, nodes.Node] = {}
    every = [tree]
    for node in every:
        for child in node.iter_child_nodes():
            parent[id(child)] = node
            every.append(child)

    def listed(expr) -> bool:  # messages, whole or sliced by constants
        if isinstance(expr, nodes.Getitem) and isinstance(expr.arg, nodes.Slice):
            bounds = (expr.arg.start, expr.arg.stop, expr.arg.step)
            return listed(expr.node) and all(b is None or _constant_int(b) for b in bounds)
        return isinstance(expr, nodes.Name) and expr.name == "messages"

    loops = {
        n.target.name for n in every if isinstance(n, nodes.For) and listed(n.iter) and isinstance(n.target, nodes.Name)
    }
    names = loops | {"messages"}
    keys = set(dir(dict))

    def written(node) -> bool:  # a content: a term of an output expression, trimmed at most
        up = parent[id(node)]
        if (
            isinstance(up, nodes.Filter)
            and up.name == "trim"
            and not (up.args or up.kwargs or up.dyn_args or up.dyn_kwargs)
        ):
            node, up = up, parent[id(up)]
        while isinstance(up, nodes.Add | nodes.Concat):
            node, up = up, parent[id(up)]
        return isinstance(up, nodes.Output)

    def message(node) -> bool:  # a message: indexed by a constant key, the content only written
        up = parent[id(node)]
        if isinstance(up, nodes.Getitem) and up.node is node and isinstance(up.arg, nodes.Const):
            key = up.arg.value
        elif isinstance(up, nodes.Getattr) and up.node is node:
            key = up.attr
        else:
            return False
        return isinstance(key, str) and key not in keys and (key != "content" or written(up))

    for node in every:
        if not isinstance(node, allowed):
            return False
        if isinstance(node, nodes.Call) and not (isinstance(node.node, nodes.Name) and node.node.name in CALLS):
            return False
        if isinstance(node, nodes.Filter) and (node.name not in FILTERS or node.name in FILTERS_OFF):
            return False
        if isinstance(node, nodes.Test) and node.name not in TESTS:
            return False
        if isinstance(node, nodes.Getattr | nodes.Getitem) and isinstance(node.node, nodes.Name):
            key = node.attr if isinstance(node, nodes.Getattr) else getattr(node.arg, "value", None)
            if node.node.name == "loop" and (key in LOOP_OFF or not isinstance(key, str)):
                return False
        if not isinstance(node, nodes.Name) or node.name not in names:
            continue
        up = parent.get(id(node))
        if node.ctx != "load":  # bound only as a loop over messages
            if not (isinstance(up, nodes.For) and up.target is node and listed(up.iter)):
                return False
        elif node.name in loops and node.name != "messages":
            if not message(node):
                return False
        elif isinstance(up, nodes.For) and up.iter is node:
            continue
        elif isinstance(up, nodes.Getitem) and up.node is node and listed(up):
            if not (isinstance(parent[id(up)], nodes.For) and parent[id(up)].iter is up):
                return False
        elif isinstance(up, nodes.Filter) and up.name == "length" and up.node is node:
            continue
        elif isinstance(up, nodes.Getitem) and up.node is node and _constant_int(up.arg):
            if not message(up):
                return False
        else:
            return False
    return True


def _constant_int(node) -> bool:
    from jinja2 import nodes

    if isinstance(node, nodes.Neg):
        node = node.node
    return isinstance(node, nodes.Const) and type(node.value) is int
