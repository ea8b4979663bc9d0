"""``neuron_parallel.testing`` is a harness for the tests and the benchmarks: no module of the
library, of ``tasks/`` or of ``flows/`` imports it, at the top or inside a function."""

from __future__ import annotations

import ast

from ..conftest import ROOT

HARNESS = "neuron_parallel.testing"


def _imported(path, package: str) -> set[str]:
    """The absolute names every import of the module at ``path`` (in ``package``) names."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".")
            base = ".".join(parts[: len(parts) - node.level + 1] if node.level else [])
            module = ".".join(x for x in (base, node.module or "") if x)
            names.add(module)
            names.update(f"{module}.{a.name}" for a in node.names)
    return names


def test_no_runtime_module_imports_the_harness():
    offenders = []
    for folder in ("neuron_parallel", "tasks", "flows"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            if rel.parts[:2] == ("neuron_parallel", "testing"):
                continue
            package = ".".join(rel.parts[:-1])
            hits = {n for n in _imported(path, package) if n == HARNESS or n.startswith(HARNESS + ".")}
            offenders += [f"{rel}: {n}" for n in sorted(hits)]
    assert not offenders, offenders
