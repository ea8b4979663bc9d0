"""`neuron-flows train` refuses bad SFT data and data settings before any training: exit code 2,
one line naming the problem and the fix, no traceback, within seconds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from neuron_parallel.tiny import TEMPLATES

from ..conftest import ROOT

CLI = Path(sys.executable).parent / "neuron-flows"
HELLO = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
LLAMA3 = str(TEMPLATES / "llama3.jinja")


def _chat(path: Path, bad, first=HELLO) -> str:
    path.write_text(json.dumps({"messages": first}) + "\n" + json.dumps({"messages": bad}) + "\n")
    return str(path)


def _bad_chat(bad):
    return lambda w, d: {"source": _chat(d / "c.jsonl", bad), "chat_template": LLAMA3}


CASES = {
    "missing-column": (
        lambda w, d: {"source": w["corpus"], "chat_template": LLAMA3},
        "no messages column 'messages'; columns: ['text']",
    ),
    "empty-messages": (_bad_chat([]), "row 1: the conversation is empty"),
    "malformed-message": (_bad_chat([{"role": "user"}]), "row 1: message 0 is not a dict with a role and a string"),
    "unknown-role": (_bad_chat([{"role": "bot", "content": "x"}]), "row 1: message 0 has role 'bot'"),
    "nothing-to-train": (
        lambda w, d: {"source": _chat(d / "c.jsonl", HELLO[:1], first=HELLO[:1]), "chat_template": LLAMA3},
        "no training example has a token to train on",
    ),
    "no-template": (
        lambda w, d: {"source": _chat(d / "c.jsonl", HELLO)},
        "set data.chat_template: path/to/template.jinja",
    ),
    "eval-fraction": (lambda w, d: {"source": w["chat"], "eval_fraction": 1.5}, "data.eval_fraction must be 0"),
    "weights-mismatch": (lambda w, d: {"source": [w["chat"]], "weights": [1, 2]}, "data.weights has 2 entries"),
    "missing-template-file": (lambda w, d: {"source": w["chat"], "chat_template": "no/such.jinja"}, "is not a file"),
    "unknown-config-name": (
        lambda w, d: {"source": w["wikitext"], "format": "text", "config": "wikitext-2-v1"},
        "has no config 'wikitext-2-v1'; set data.config to one of",
    ),
}
"""Each case: the data section over a chat config, and what the refusal must say."""


@pytest.mark.parametrize("case", sorted(CASES))
def test_train_refuses_bad_data_in_seconds(tiny_world, tmp_path, case):
    data_of, message = CASES[case]
    data = {
        "format": "chat",
        "block_size": 64,
        "cache_dir": str(tmp_path / "datasets"),
        **data_of(tiny_world, tmp_path),
    }
    config = {
        "model": {"name_or_path": tiny_world["model"]},
        "data": data,
        "parallel": {"tp": 1, "pp": 1},
        "train": {"max_steps": 2, "global_batch_size": 2},
        "launch": {"device": "cpu", "nproc_per_node": 1},
        "output": {"dir": str(tmp_path / "run")},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    start = time.monotonic()
    proc = subprocess.run(
        [str(CLI), "train", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    took = time.monotonic() - start
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert message in proc.stderr, proc.stderr[-3000:]
    assert took < 10, f"the refusal took {took:.1f} s"
    assert not (tmp_path / "run").exists()


def _users_folder(d: Path) -> Path:
    (d / "models").mkdir()
    (d / "models" / "model.safetensors").write_bytes(b"the user's weights")
    return d / "models"


def _a_file(d: Path) -> Path:
    (d / "notes.txt").write_text("a user's file")
    return d / "notes.txt"


SETTINGS = {
    "hub-repo-id": (lambda w, d: {"hub.repo_id": "bad repo!!"}, "'bad repo!!' is not a Hub repo id"),
    "hub-plain-http": (lambda w, d: {"hub.endpoint": "http://hub.example.com"}, "is not an https:// URL"),
    "resume-from-missing": (lambda w, d: {"train.resume_from": str(d / "gone")}, "does not exist"),
    "output-dir-is-a-file": (lambda w, d: {"output.dir": str(_a_file(d))}, "is a file"),
    "consolidated-dir-of-other-files": (
        lambda w, d: {"output.consolidated_dir": str(_users_folder(d))},
        "already holds files neuron-flows did not write",
    ),
    "block-beyond-positions": (
        lambda w, d: {"data.block_size": 4096},
        "exceeds the model's max_position_embeddings=1024",
    ),
    "eval-without-eval-data": (lambda w, d: {"train.eval_every": 5}, "needs evaluation data"),
}
"""Each case: --set overrides of the tiny config, and what the refusal must say."""


@pytest.mark.parametrize("case", sorted(SETTINGS))
def test_train_refuses_bad_settings_before_any_data_is_read(tiny_world, tmp_path, case):
    sets_of, message = SETTINGS[case]
    base = {
        "model.name_or_path": tiny_world["model"],
        "data.source": tiny_world["corpus"],
        "data.cache_dir": str(tmp_path / "datasets"),
        "output.dir": str(tmp_path / "run"),
        "launch.nproc_per_node": 1,
        "parallel.tp": 1,
        "parallel.pp": 1,
    }
    sets = {**base, **sets_of(tiny_world, tmp_path)}
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    cmd = [str(CLI), "train", str(ROOT / "configs" / "tiny-llama-cpu.yaml")]
    for key, value in sets.items():
        cmd += ["--set", f"{key}={value}"]
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT, env=os.environ)
    took = time.monotonic() - start
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and message in proc.stderr, proc.stderr[-3000:]
    assert took < 10, f"the refusal took {took:.1f} s"
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before  # nothing on disk changed
    assert not (tmp_path / "datasets").exists()  # refused before tokenization
