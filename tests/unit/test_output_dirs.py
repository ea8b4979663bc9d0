"""The tool never writes into, or removes from, a directory it did not create: a run's
``output.dir`` (training, resume, ``job.json``, metrics, checkpoints), every export (full, adapter,
merged, both) and the consolidated model are new, empty or created by neuron-flows (they hold its
marker); anything else is refused before a byte is written, with exit code 2 through the CLI, and
every file there stays byte for byte what it was. A consolidated model that replaces an earlier
run's is staged beside it, swapped in only once published, and dropped on failure."""

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from neuron_flows.tasks import steps
from neuron_flows.tasks.config import FinetuneConfig
from neuron_flows.tasks.consolidate import _discard_staged
from neuron_parallel.checkpoint import export_checkpoint
from neuron_parallel.checkpoint.format import base_model_identity
from neuron_parallel.checkpoint.output import (
    OWNER_FILE,
    OutputDirRefused,
    claim_run_dir,
    discard_staged,
    is_ours,
    replace_with_staged,
    stage_output_dir,
    staged_dir,
)
from neuron_parallel.checkpoint.save import CheckpointSaveFailed, CheckpointWriter
from neuron_parallel.config import JobConfig, LaunchConfig

from .test_checkpoint_hardening import make_checkpoint

ROOT = Path(__file__).resolve().parents[2]
CKPT = ROOT / "tests" / "fixtures" / "optimum-neuron" / "ckpt_tp2_base"
CLI = Path(sys.executable).parent / "neuron-flows"
COORDS = {"tp_rank": 0, "pp_rank": 0, "dp_rank": 0}


def _hashes(root: Path) -> dict[str, str]:
    """The sha256 of every file under ``root``, by relative path (folders included, as empty)."""
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        for p in sorted(root.rglob("*"))
    }


def _write(root: Path, files: dict[str, bytes]) -> Path:
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return root


def _users_folder(path: Path) -> Path:
    """A folder of someone else's files, such as a base model directory."""
    return _write(
        path, {"model.safetensors": b"the user's weights", "model.safetensors.index.json": b"{}", "notes.txt": b"mine"}
    )


def _users_adapter(path: Path) -> Path:
    """Someone else's peft adapter: the very names an adapter export writes."""
    return _write(
        path,
        {"adapter_config.json": b'{"r": 8}', "adapter_model.safetensors": b"their adapter", "README.md": b"theirs"},
    )


def _other_tools_run(path: Path) -> Path:
    """Another trainer's output folder, with names neuron-flows also writes (a Hugging Face
    Trainer saves ``checkpoint-<step>`` folders too)."""
    return _write(
        path,
        {
            "checkpoint-2/model.safetensors": b"their step-2 weights",
            "checkpoint-2/trainer_state.json": b'{"global_step": 2}',
            "checkpoint-4.tmp/optimizer.pt": b"their partial save",
            "metrics.jsonl": b'{"step": 1, "loss": 3.0}\n{"step": 2, "loss": 2.5}\n',
            "job.json": b'{"their": "job"}',
            "memory.json": b"[]",
        },
    )


def _cli(argv: list[str]) -> int:
    """``neuron-flows`` in this process (it sets signal handlers; they are put back)."""
    from neuron_flows.flows.cli import main

    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)}
    try:
        return main(argv)
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)


def _refused(capfd, code: int) -> str:
    err = capfd.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and err.count("error:") == 1 and "did not write" in err, err
    return err


@pytest.fixture
def lora(tmp_path) -> dict[str, Path]:
    """A LoRA checkpoint (written as the trainer writes one) and the base model it was trained on."""
    base = tmp_path / "base"
    base.mkdir()
    save_file({"model.norm.weight": torch.ones(4)}, str(base / "model.safetensors"))
    (base / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 8}))
    lora = {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj"], "modules_to_save": []}
    ckpt = make_checkpoint(tmp_path / "lora-run", adapter={"lora": lora, "base_model": base_model_identity(base)})
    return {"checkpoint": ckpt, "base": base}


# -- exports: full, adapter, merged, both


@pytest.mark.parametrize("kind", ["full", "adapter", "merged"])
def test_consolidate_into_someone_elses_folder_exits_2_and_changes_nothing(kind, lora, tmp_path, capfd):
    if kind == "full":
        args = [str(CKPT)]
    else:
        args = [str(lora["checkpoint"]), *(["--merge", "--base-dir", str(lora["base"])] if kind == "merged" else [])]
    theirs = _users_adapter(tmp_path / "theirs")
    before = _hashes(tmp_path)
    err = _refused(capfd, _cli(["consolidate", args[0], str(theirs), *args[1:]]))
    assert str(theirs) in err and "name a new or empty directory" in err
    assert _hashes(tmp_path) == before
    # The same command into a new folder works: the folder alone was the reason.
    assert _cli(["consolidate", args[0], str(tmp_path / "new"), *args[1:]]) == 0
    written = {"full": "model.safetensors", "adapter": "adapter_model.safetensors", "merged": "model.safetensors"}
    assert is_ours(tmp_path / "new") and (tmp_path / "new" / written[kind]).is_file()


def test_the_installed_command_refuses_a_merge_into_someone_elses_adapter(lora, tmp_path):
    """As a shell sees it: exit 2 and one line."""
    theirs = _users_adapter(tmp_path / "theirs")
    before = _hashes(tmp_path)
    cmd = [str(CLI), "consolidate", str(lora["checkpoint"]), str(theirs), "--merge", "--base-dir", str(lora["base"])]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert (
        proc.stderr.count("error:") == 1 and f"{theirs} already holds files neuron-flows did not write" in proc.stderr
    )
    assert _hashes(tmp_path) == before


def test_an_export_of_both_checks_its_merged_folder_before_writing_anything(lora, tmp_path):
    out = export_checkpoint(lora["checkpoint"], tmp_path / "out", kind="merged", base_dir=lora["base"])  # ours
    _users_folder(out / "merged")  # someone put their model where kind both writes the merged one
    before = _hashes(tmp_path)
    with pytest.raises(ValueError, match=f"{out / 'merged'} already holds files neuron-flows did not write"):
        export_checkpoint(lora["checkpoint"], out, kind="both", base_dir=lora["base"])
    assert _hashes(tmp_path) == before
    with pytest.raises(ValueError, match="did not write"):
        export_checkpoint(lora["checkpoint"], tmp_path / "base", kind="merged", base_dir=lora["base"])
    assert _hashes(tmp_path) == before


def test_a_new_or_earlier_output_is_written_and_marked(tmp_path):
    out = export_checkpoint(CKPT, tmp_path / "hf")
    assert is_ours(out) and (out / "model.safetensors").is_file()
    first = (out / "model.safetensors").read_bytes()
    assert export_checkpoint(CKPT, out) == out  # a retry writes over its own output
    assert (out / "model.safetensors").read_bytes() == first
    (tmp_path / "empty").mkdir()
    assert is_ours(export_checkpoint(CKPT, tmp_path / "empty"))


# -- a run's output.dir: config load, preflight, the launcher, the ranks, the checkpoint writer


def test_train_into_another_tools_output_dir_exits_2_and_changes_nothing(tmp_path):
    """The installed command, as a shell runs it: refused at config load, before any data is read."""
    theirs = _other_tools_run(tmp_path / "their-run")
    before = _hashes(tmp_path)
    cmd = [str(CLI), "train", str(ROOT / "configs/tiny-llama-cpu.yaml"), "--set", f"output.dir={theirs}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and proc.stderr.count("error:") == 1, proc.stderr[-3000:]
    assert "output.dir" in proc.stderr and "did not write" in proc.stderr and "train.resume_from" in proc.stderr
    assert _hashes(tmp_path) == before


def test_a_run_dir_named_by_the_flow_run_is_refused_by_preflight(tmp_path):
    theirs = _other_tools_run(tmp_path / "nightly")
    config = FinetuneConfig.load(None, [f"output.dir={tmp_path}/{{flow_run_name}}"]).for_run("nightly", "id")
    before = _hashes(tmp_path)
    with pytest.raises(ValueError, match=f"output.dir={theirs} already holds files neuron-flows did not write"):
        steps.preflight(config)
    assert _hashes(tmp_path) == before


def test_a_consolidated_dir_or_its_staging_folder_of_other_files_is_refused_by_preflight(tmp_path):
    config = FinetuneConfig.load(None, [f"output.dir={tmp_path}/{{flow_run_name}}"]).for_run("run", "id")
    _users_folder(claim_run_dir(tmp_path / "run") / "consolidated")  # in a run dir of ours, someone's model
    with pytest.raises(ValueError, match="output.consolidated_dir=.*did not write"):
        steps.preflight(config)
    config = FinetuneConfig.load(None, [f"output.consolidated_dir={tmp_path / 'models' / 'ft'}"])
    _users_folder(tmp_path / "models" / "ft.staging")
    before = _hashes(tmp_path)
    with pytest.raises(ValueError, match=r"output.consolidated_dir \(its staging folder\)=.*did not write"):
        steps.preflight(config)
    assert _hashes(tmp_path) == before


def _job(output_dir: Path) -> JobConfig:
    return JobConfig(model_path="m", dataset_path="d", output_dir=str(output_dir), launch=LaunchConfig(timeout_s=15))


def test_the_launcher_and_the_ranks_refuse_another_tools_run_dir(tmp_path):
    """What the config check cannot see (a job built in code, or handed to the ranks directly)."""
    from neuron_parallel.launch import run_torchrun
    from neuron_parallel.train import train_job

    theirs = _other_tools_run(tmp_path / "their-run")
    before = _hashes(tmp_path)
    with pytest.raises(OutputDirRefused, match="output.dir=.*did not write"):
        run_torchrun(_job(theirs), LaunchConfig(nproc_per_node=1))  # before job.json is written
    with pytest.raises(OutputDirRefused, match="output.dir=.*did not write"):
        train_job(_job(theirs))  # on every rank, before anything is read or written
    assert _hashes(tmp_path) == before


def _save(writer: CheckpointWriter, step: int) -> Path:
    return writer.save(
        step,
        model={"w": torch.full((4, 4), float(step))},
        optim={"w.exp_avg": torch.zeros(4, 4)},
        parallel={"tp": 1, "pp": 1, "dp": 1},
        trainer_state={"step": step},
    )


@pytest.fixture
def model_dir(tmp_path) -> Path:
    return _write(tmp_path / "model", {"config.json": b'{"model_type": "llama"}', "tokenizer.json": b"{}"})


def test_the_checkpoint_writer_never_replaces_another_tools_checkpoint(tmp_path, model_dir):
    theirs = _other_tools_run(tmp_path / "their-run")
    before = _hashes(tmp_path)
    writer = CheckpointWriter(theirs, coords=COORDS, model_dir=model_dir)
    with pytest.raises(OutputDirRefused, match="did not write"):
        writer.remove_partial()  # their checkpoint-4.tmp stays
    with pytest.raises(CheckpointSaveFailed, match="did not write"):
        _save(writer, 2)  # their checkpoint-2 stays
    assert _hashes(tmp_path) == before


def test_resuming_in_a_run_dir_the_tool_created_keeps_working(tmp_path, model_dir):
    run = tmp_path / "run"
    writer = CheckpointWriter(run, coords=COORDS, model_dir=model_dir)
    assert writer.remove_partial() == [] and _save(writer, 1).is_dir() and is_ours(run)
    (run / "checkpoint-2.tmp").mkdir()  # a save cut short
    again = CheckpointWriter(run, coords=COORDS, model_dir=model_dir)
    assert again.remove_partial() == ["checkpoint-2.tmp"] and _save(again, 2).is_dir()
    config = FinetuneConfig.load(None, [f"output.dir={run}"])  # load and preflight accept it
    from neuron_parallel.checkpoint.output import check_run_dir

    assert check_run_dir(config.output.dir) == run and claim_run_dir(run) == run


def test_a_config_naming_another_tools_output_dir_is_refused_at_load(tmp_path):
    theirs = _other_tools_run(tmp_path / "their-run")
    before = _hashes(tmp_path)
    with pytest.raises(ValueError, match=r"output\.dir: .*already holds files neuron-flows did not write.*resume_from"):
        FinetuneConfig.load(None, [f"output.dir={theirs}"])
    with pytest.raises(ValueError, match=r"output\.dir: .* is a file"):
        FinetuneConfig.load(None, [f"output.dir={theirs / 'job.json'}"])
    assert _hashes(tmp_path) == before


def test_a_config_naming_a_foreign_consolidated_dir_is_refused_at_load(tmp_path):
    _users_folder(tmp_path / "base")
    with pytest.raises(ValueError, match="output.consolidated_dir"):
        FinetuneConfig.load(None, [f"output.consolidated_dir={tmp_path / 'base'}"])


# -- the consolidated model: staged beside the earlier one, swapped in once published


class _Txn:
    def __init__(self, path):
        self.values = {"model_dir": str(path)}

    def get(self, key, default=None):
        return self.values.get(key, default)


def _staged_model(final: Path) -> Path:
    """A new model staged for ``final``, as the consolidate step writes it."""
    staged = stage_output_dir(final)
    return export_checkpoint(CKPT, staged, fmt="pytorch")  # other files than the earlier model's


def test_a_failed_upload_drops_the_staged_model_and_keeps_the_earlier_one(tmp_path):
    final = export_checkpoint(CKPT, tmp_path / "ft")  # an earlier run's model
    before, earlier = _hashes(tmp_path), _hashes(final)
    assert _staged_model(final) == tmp_path / "ft.staging" / "ft"
    assert _hashes(final) == earlier  # staged beside it, the earlier model untouched
    _discard_staged(_Txn(final))  # the flow's rollback
    assert _hashes(tmp_path) == before


def test_a_published_model_replaces_the_earlier_one(tmp_path):
    final = export_checkpoint(CKPT, tmp_path / "ft")
    new = _hashes(_staged_model(final))
    assert replace_with_staged(final) == final
    assert _hashes(final) == new and is_ours(final) and sorted(p.name for p in tmp_path.iterdir()) == ["ft"]
    _staged_model(tmp_path / "first")  # nothing there before: the staged model simply moves in
    assert is_ours(replace_with_staged(tmp_path / "first")) and not (tmp_path / "first.staging").exists()


def test_a_swap_cut_short_puts_the_earlier_model_back(tmp_path):
    final = export_checkpoint(CKPT, tmp_path / "ft")
    before = _hashes(tmp_path)
    _staged_model(final)
    final.rename(tmp_path / "ft.staging" / "ft.previous")  # the swap's first rename, then a crash
    discard_staged(final)
    assert _hashes(tmp_path) == before


def test_staging_never_removes_what_the_tool_did_not_write(tmp_path):
    final = export_checkpoint(CKPT, tmp_path / "ft")
    _users_folder(tmp_path / "ft.staging")
    before = _hashes(tmp_path)
    discard_staged(final)
    _discard_staged(_Txn(final))
    with pytest.raises(OutputDirRefused, match="ft.staging already holds files neuron-flows did not write"):
        stage_output_dir(final)
    assert _hashes(tmp_path) == before
    staged = _staged_model(tmp_path / "later")
    _users_folder(tmp_path / "later")  # someone's folder appeared there while the model was uploaded
    before = _hashes(tmp_path)
    with pytest.raises(OutputDirRefused, match="did not write"):
        replace_with_staged(tmp_path / "later")  # never over someone else's folder
    assert _hashes(tmp_path) == before and staged == staged_dir(tmp_path / "later") and is_ours(staged)
    assert not (tmp_path / "later" / OWNER_FILE).exists()
