"""Bad input is refused in the earliest phase that can know it, with one message naming the key
and the fix, and nothing already on disk changed: through the real CLI (exit code 2, no
traceback) and through a flow run on a real Prefect server (the run fails in that phase's step,
not retried, with the message as its state).

Phases: ``load`` (the config itself: YAML, keys, values, paths the config names), ``preflight``
(this machine's devices, the model's and the data's files, the Hub; before any data is read),
``tokenize`` (the data's contents; before any rank starts)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from neuron_flows.tasks.config import ALLOWED_HUB_ENDPOINTS_ENV
from neuron_parallel.tiny import TEMPLATES

from ..conftest import HUB_PORT, ROOT, UNREACHABLE_HUB
from ..hub_server import LocalHub

CLI = Path(sys.executable).parent / "neuron-flows"
CONFIG = ROOT / "configs" / "tiny-llama-cpu.yaml"
HELLO = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
LLAMA3 = str(TEMPLATES / "llama3.jinja")
PHASES = ("load", "preflight", "tokenize", "train")


@dataclass(frozen=True)
class Case:
    sets: Callable[[dict, Path], dict]
    """--set overrides over the base run, from the tiny world (and ``hub``, the local Hub's URL)
    and a scratch folder."""
    message: str
    """What the refusal must say (the key or the file, and the fix)."""
    phase: str
    command: str = "train"
    """The CLI command: ``run`` for what only the whole pipeline (the upload) needs."""
    config: Callable[[Path], list[str]] | None = None
    """For a problem of the command line itself: the arguments after the command (no flow run)."""
    key: str | None = None
    """The config key the refusal must name; by default the one key ``sets`` gives, if it gives one."""

    def keys(self, sets: dict) -> list[str]:
        """The keys the refusal must name."""
        return [self.key] if self.key else list(sets) if len(sets) == 1 else []


def _write(path: Path, text: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return str(path)


def _chat(d: Path, bad, first=HELLO) -> str:
    return _write(d / "data" / "c.jsonl", json.dumps({"messages": first}) + "\n" + json.dumps({"messages": bad}) + "\n")


def _pairs(d: Path, rows: list[dict]) -> dict:
    """Preference data (ORPO, which needs no reference) of ``rows``."""
    source = _write(d / "data" / "p.jsonl", "".join(json.dumps(row) + "\n" for row in rows))
    return {"data.format": "preference", "data.source": source, "train.objective": "orpo"}


def _bad_chat(bad):
    return lambda w, d: {"data.format": "chat", "data.source": _chat(d, bad), "data.chat_template": LLAMA3}


def _model_copy(w: dict, d: Path) -> Path:
    dst = d / "models" / "copy"
    shutil.copytree(w["model"], dst)
    return dst


def _without_layer(w: dict, d: Path) -> dict:
    from safetensors.torch import load_file, save_file

    model = _model_copy(w, d)
    tensors = load_file(model / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if ".layers.3." not in k}, model / "model.safetensors")
    return {"model.name_or_path": str(model)}


def _bigger_tokenizer(w: dict, d: Path) -> dict:
    from transformers import AutoTokenizer

    model = _model_copy(w, d)
    tok = AutoTokenizer.from_pretrained(model)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    tok.add_tokens([f"<extra_{i}>" for i in range(vocab - len(tok) + 8)])
    tok.save_pretrained(model)
    return {"model.name_or_path": str(model)}


def _broken_model_config(w: dict, d: Path) -> dict:
    model = _model_copy(w, d)
    (model / "config.json").write_text('{"model_type": ')
    return {"model.name_or_path": str(model)}


def _mc_task(d: Path) -> str:
    """A local lm-eval multiple-choice task (its data beside it) whose one metric is acc."""
    data = _write(d / "lm-eval" / "mc.jsonl", json.dumps({"question": "q", "choices": ["a", "b"], "label": 0}))
    task = {"task": "tiny_mc", "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": data}}}
    task |= {"test_split": "test", "output_type": "multiple_choice", "doc_to_text": "{{question}}"}
    task |= {"doc_to_choice": "{{choices}}", "doc_to_target": "label", "metric_list": [{"metric": "acc"}]}
    return _write(d / "lm-eval" / "mc.yaml", yaml.safe_dump(task))


def _users_folder(d: Path) -> str:
    return _write(d / "models" / "model.safetensors", "the user's weights").rsplit("/", 1)[0]


CASES: dict[str, Case] = {
    # -- the command line and the config file (no flow run has these)
    "broken-yaml": Case(
        lambda w, d: {},
        "is not valid YAML: expected ',' or ']'",
        "load",
        config=lambda d: [_write(d / "run.yaml", "model:\n  name_or_path: [oops\ntrain: {\n")],
    ),
    "missing-config-file": Case(lambda w, d: {}, "does not exist", "load", config=lambda d: [str(d / "nowhere.yaml")]),
    "set-without-equals": Case(
        lambda w, d: {},
        "write it as dotted.key=value",
        "load",
        config=lambda d: [str(CONFIG), "--set", "parallel.tp"],
    ),
    # -- the config's keys and values
    "unknown-key": Case(lambda w, d: {"train.learning_rte": 1e-4}, "learning_rte", "load"),
    "negative-lr": Case(lambda w, d: {"train.lr": -1.0}, "train.lr", "load"),
    "zero-block-size": Case(lambda w, d: {"data.block_size": 0}, "data.block_size", "load"),
    "zero-ranks": Case(lambda w, d: {"launch.nproc_per_node": 0}, "launch.nproc_per_node", "load"),
    "unknown-format": Case(lambda w, d: {"data.format": "xml"}, "data.format", "load"),
    "lora-rank-zero": Case(lambda w, d: {"train.lora": {"r": 0}}, "train.lora.r", "load"),
    "tp-beyond-world": Case(lambda w, d: {"parallel.tp": 4}, "is not divisible by cp × tp × pp", "load"),
    "hub-repo-id": Case(lambda w, d: {"hub.repo_id": "bad repo!!"}, "'bad repo!!' is not a Hub repo id", "load"),
    "hub-plain-http": Case(lambda w, d: {"hub.endpoint": "http://hub.example.com"}, "is not an https:// URL", "load"),
    "hub-endpoint-not-allowed": Case(
        lambda w, d: {"hub.repo_id": "user/x", "hub.endpoint": "https://evil.example"},
        "'https://evil.example' is not a Hub endpoint this machine allows; the Hub token goes only to "
        f"https://huggingface.co, $HF_ENDPOINT and the base URLs in ${ALLOWED_HUB_ENDPOINTS_ENV}",
        "load",
        command="run",
    ),
    "hub-loopback-not-listed": Case(
        lambda w, d: {"hub.repo_id": "user/x", "hub.endpoint": "http://localhost:8"},
        f"to allow it, the operator adds http://localhost:8 to {ALLOWED_HUB_ENDPOINTS_ENV}",
        "load",
        command="run",
    ),
    "resume-from-missing": Case(lambda w, d: {"train.resume_from": str(d / "gone")}, "does not exist", "load"),
    "output-dir-is-a-file": Case(
        lambda w, d: {"output.dir": _write(d / "notes.txt", "a user's file")}, "is a file", "load"
    ),
    "consolidated-dir-of-other-files": Case(
        lambda w, d: {"output.consolidated_dir": _users_folder(d)},
        "already holds files neuron-flows did not write",
        "load",
    ),
    "eval-without-eval-data": Case(lambda w, d: {"train.eval_every": 5}, "needs evaluation data", "load"),
    "eval-fraction": Case(
        lambda w, d: {"data.format": "chat", "data.source": w["chat"], "data.eval_fraction": 1.5},
        "data.eval_fraction must be 0",
        "load",
    ),
    "weights-mismatch": Case(
        lambda w, d: {"data.format": "chat", "data.source": [w["chat"]], "data.weights": [1, 2]},
        "data.weights has 2 entries",
        "load",
    ),
    "missing-template-file": Case(
        lambda w, d: {"data.format": "chat", "data.source": w["chat"], "data.chat_template": "no/such.jinja"},
        "is not a file",
        "load",
    ),
    "evaluate-prompts-missing": Case(
        lambda w, d: {"evaluate.prompts": str(d / "prompts.jsonl")}, "evaluate.prompts=", "load"
    ),
    "evaluate-gate-without-eval-rows": Case(
        lambda w, d: {"evaluate.gate": {"metric": "eval_loss"}},
        "evaluate.gate.metric=eval_loss needs evaluation rows",
        "load",
    ),
    "evaluate-hub-baseline-without-repo": Case(
        lambda w, d: {"evaluate.gate": {"baseline": "hub"}, "data.eval_fraction": 0.1},
        "evaluate.gate.baseline=hub compares with the model published at hub.repo_id, which is not set",
        "load",
    ),
    # -- this machine, the model's and the data's files, the Hub
    "cuda-without-cuda": Case(
        lambda w, d: {"launch.device": "cuda"}, "launch.device=cuda but this machine", "preflight"
    ),
    "neuron-without-runtime": Case(lambda w, d: {"launch.device": "neuron"}, "torch-neuronx", "preflight"),
    "model-missing": Case(lambda w, d: {"model.name_or_path": str(d / "no-model")}, "does not exist", "preflight"),
    "model-without-config": Case(
        lambda w, d: {"model.name_or_path": _users_folder(d)}, "has no config.json", "preflight"
    ),
    "model-config-broken": Case(_broken_model_config, "config.json does not load as a model config", "preflight"),
    "weights-missing-for-a-layer": Case(
        _without_layer, "weights of the model its config.json describes are missing: model.layers.3.", "preflight"
    ),
    "tokenizer-beyond-vocab": Case(_bigger_tokenizer, "ids from", "preflight"),
    "block-beyond-positions": Case(
        lambda w, d: {"data.block_size": 4096}, "exceeds the model's max_position_embeddings=1024", "preflight"
    ),
    "tp-not-dividing-heads": Case(
        lambda w, d: {"parallel.tp": 3, "launch.nproc_per_node": 3}, "does not divide num_attention_heads", "preflight"
    ),
    "data-missing": Case(lambda w, d: {"data.source": str(d / "no.jsonl")}, "no such file or directory", "preflight"),
    "empty-corpus": Case(lambda w, d: {"data.source": _write(d / "data" / "e.jsonl", "")}, "is empty", "preflight"),
    "hub-unreachable": Case(
        lambda w, d: {"hub.repo_id": "user/x", "hub.endpoint": UNREACHABLE_HUB},
        "cannot be reached",
        "preflight",
        command="run",
        key="hub.endpoint",
    ),
    "hub-token-refused": Case(
        lambda w, d: {"hub.repo_id": "user/x", "hub.endpoint": w["hub"]},
        "refused the Hub token (401)",
        "preflight",
        command="run",
    ),
    "evaluate-unknown-lm-eval-task": Case(
        lambda w, d: {"evaluate.lm_eval_tasks": ["arc_easyy"]},
        "evaluate.lm_eval_tasks: 'arc_easyy' is not an lm-eval task (did you mean arc_easy or",
        "preflight",
    ),
    "evaluate-gate-figure-no-task-makes": Case(
        lambda w, d: {"evaluate.lm_eval_tasks": [_mc_task(d)], "evaluate.gate": {"metric": "tiny_mc/f1"}},
        "evaluate.gate.metric='tiny_mc/f1' is produced by no task of evaluate.lm_eval_tasks",
        "preflight",
    ),
    # -- the data's contents
    "missing-column": Case(
        lambda w, d: {"data.format": "chat", "data.source": w["corpus"], "data.chat_template": LLAMA3},
        "no messages column 'messages'; columns: ['text']",
        "tokenize",
        key="data.format",
    ),
    "empty-messages": Case(_bad_chat([]), "row 1: the conversation is empty", "tokenize"),
    "malformed-message": Case(
        _bad_chat([{"role": "user"}]), "row 1: message 0 is not a dict with a role and a string", "tokenize"
    ),
    "unknown-role": Case(_bad_chat([{"role": "bot", "content": "x"}]), "row 1: message 0 has role 'bot'", "tokenize"),
    "nothing-to-train": Case(
        lambda w, d: {
            "data.format": "chat",
            "data.source": _chat(d, HELLO[:1], first=HELLO[:1]),
            "data.chat_template": LLAMA3,
        },
        "no training example has a token to train on",
        "tokenize",
    ),
    "no-template": Case(
        lambda w, d: {"data.format": "chat", "data.source": _chat(d, HELLO)},
        "set data.chat_template: path/to/template.jinja",
        "tokenize",
    ),
    "preference-missing-column": Case(
        lambda w, d: _pairs(d, [{"prompt": "q", "better": "yes", "rejected": "no"}] * 2),
        "has no chosen column 'chosen'; columns: ['prompt', 'better', 'rejected']; set data.chosen_field",
        "tokenize",
        key="data.chosen_field",
    ),
    "preference-empty-completion": Case(
        lambda w, d: _pairs(
            d, [{"prompt": "q", "chosen": "yes", "rejected": "no"}, {"prompt": "q", "chosen": "yes", "rejected": ""}]
        ),
        "data.source row 1: the rejected completion (column 'rejected') is empty; every pair needs a non-empty "
        "chosen and rejected completion: fix or remove the row",
        "tokenize",
    ),
    "unknown-config-name": Case(
        lambda w, d: {"data.source": w["wikitext"], "data.config": "wikitext-2-v1"},
        "has no config 'wikitext-2-v1'; set data.config to one of",
        "tokenize",
    ),
}


def _base(w: dict, d: Path) -> dict:
    return {
        "model.name_or_path": w["model"],
        "data.source": w["corpus"],
        "data.block_size": 64,
        "data.cache_dir": str(d / "datasets"),
        "output.dir": str(d / "run"),
        "launch.nproc_per_node": 1,
        "parallel.tp": 1,
        "parallel.pp": 1,
        "train.max_steps": 2,
    }


def _snapshot(d: Path) -> dict:
    return {p: p.read_bytes() for p in d.rglob("*") if p.is_file()}


def _reached(d: Path) -> str:
    """The furthest phase whose effects are on disk: tokenization writes the dataset cache,
    training the run directory; a refusal in an earlier phase leaves neither."""
    return "train" if (d / "run").exists() else "tokenize" if (d / "datasets").exists() else "load"


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    with LocalHub(tmp_path_factory.mktemp("hub"), port=HUB_PORT) as server:
        yield server


def _prepare(case: Case, tiny_world, d: Path, hub) -> dict:
    return {**_base(tiny_world, d), **case.sets({**tiny_world, "hub": hub.url}, d)}


def _cli_args(case: Case, d: Path, sets: dict) -> list[str]:
    if case.config is not None:
        return [case.command, *case.config(d)]
    args = [case.command, str(CONFIG)]
    for key, value in sets.items():
        args += ["--set", f"{key}={json.dumps(value) if isinstance(value, (list, dict)) else value}"]
    return args


def _check_refusal(name: str, case: Case, d: Path, before: dict, code: int, stderr: str, how: str, sets: dict) -> None:
    assert code == 2, stderr[-3000:]
    assert "Traceback" not in stderr and case.message in stderr, stderr[-3000:]
    assert all(key in stderr for key in case.keys(sets)), f"the refusal does not name {case.keys(sets)}: {stderr}"
    assert stderr.count("error:") == 1, stderr[-3000:]
    assert _snapshot(d) == before, "a refusal changed files on disk"
    assert PHASES.index(_reached(d)) <= PHASES.index(case.phase), f"refused only after {_reached(d)}"
    print(f"BAD-INPUT {name}: {how} refused at {case.phase}")


@pytest.mark.parametrize("name", list(CASES))
def test_the_cli_refuses_it_with_exit_2(tiny_world, tmp_path, hub, monkeypatch, capfd, name):
    """The CLI's own entry point, in this process (one Python start-up for the whole table)."""
    from neuron_flows.flows.cli import main

    case = CASES[name]
    d = tmp_path / "case"
    d.mkdir()
    sets = _prepare(case, tiny_world, d, hub)
    args = _cli_args(case, d, sets)
    before = _snapshot(d)
    monkeypatch.setenv("HF_TOKEN", "hf_refused")
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)}
    try:
        code = main(args)
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    _check_refusal(name, case, d, before, code, capfd.readouterr().err, "cli", sets)


@pytest.mark.parametrize("name", ["broken-yaml", "cuda-without-cuda", "unknown-role", "hub-unreachable"])
def test_the_installed_command_refuses_it_with_exit_2(tiny_world, tmp_path, hub, name):
    """One case per phase (and the upload's) through the installed `neuron-flows` in a process of
    its own: the exit code and stderr a shell sees."""
    case = CASES[name]
    d = tmp_path / "case"
    d.mkdir()
    sets = _prepare(case, tiny_world, d, hub)
    args = _cli_args(case, d, sets)
    before = _snapshot(d)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_TOKEN": "hf_refused", "PREFECT_HOME": str(tmp_path / "prefect")}
    proc = subprocess.run([str(CLI), *args], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    _check_refusal(name, case, d, before, proc.returncode, proc.stderr, "neuron-flows", sets)


def test_a_flow_run_refuses_each_in_its_phase(prefect_server, tiny_world, tmp_path, hub, monkeypatch):
    """Every case a flow run can be given (all but the command line's own), one flow run each:
    a value the config refuses fails the run's parameter validation before any step; the others
    fail in the step of their phase, once, with the message."""
    import anyio
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    from neuron_flows.flows.finetune import finetune
    from neuron_flows.tasks.config import _apply_override

    monkeypatch.setenv("HF_TOKEN", "hf_refused")
    base = yaml.safe_load(CONFIG.read_text())

    async def task_runs(flow_run_id):
        async with get_client() as client:
            runs = await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
        return [(r.name.rsplit("-", 1)[0], r.state.type.value, r.run_count) for r in runs]

    failures = []
    for name, case in CASES.items():
        if case.config is not None:
            continue
        d = tmp_path / name
        d.mkdir()
        sets = _prepare(case, tiny_world, d, hub)
        data = json.loads(json.dumps(base))
        for key, value in sets.items():
            _apply_override(data, f"{key}={json.dumps(value) if isinstance(value, (list, dict)) else value}")
        before = _snapshot(d)
        state = finetune(config=data, return_state=True)
        text = f"{state.message} {state.result(raise_on_failure=False)}"
        ran = anyio.run(task_runs, state.state_details.flow_run_id)
        failed = [t for t in ran if t[1] == "FAILED"]
        if case.phase == "load":
            ok = not ran and "validation" in text.lower()
        else:
            ok = [f[0] for f in failed] == [case.phase] and failed[0][2] == 1
            ok = ok and state.message.startswith(f"failed step: {case.phase}\n")  # what a notification quotes
        ok = ok and state.is_failed() and case.message in text and _snapshot(d) == before
        ok = ok and all(key in text for key in case.keys(sets))
        ok = ok and PHASES.index(_reached(d)) <= PHASES.index(case.phase)
        print(f"BAD-INPUT {name}: flow refused at {case.phase if ok else '?'} ({ran})")
        if not ok:
            failures.append((name, case.phase, ran, text[:600]))
    assert not failures, failures
