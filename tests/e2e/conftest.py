"""The end-to-end tier's fixtures."""

from __future__ import annotations

import shutil

import pytest

from ..conftest import ROOT
from .service_helpers import Service


@pytest.fixture(scope="session")
def repo_tiny():
    """The tiny model, tokenizer and corpus in the repository's .tiny/, which the deployments'
    defaults read (made if missing, as `make demo` does)."""
    if not (ROOT / ".tiny" / "model" / "config.json").exists():
        from neuron_parallel.tiny import make_tiny_world

        make_tiny_world(ROOT / ".tiny")


@pytest.fixture(scope="module")
def service_env() -> dict[str, str]:
    """Environment variables for the module's `neuron-flows serve`; a module overrides it."""
    return {}


@pytest.fixture(scope="module")
def service(tmp_path_factory, repo_tiny, service_env):
    svc = Service(tmp_path_factory.mktemp("prefect-home"), extra_env=service_env)
    made = []
    svc.made = made
    yield svc
    code = svc.stop()
    for path in made:
        shutil.rmtree(path, ignore_errors=True)
    assert code == 0, "\n".join(svc.lines[-40:])
    assert svc.lines[-1] == "stopped"
