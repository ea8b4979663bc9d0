"""The tool never deletes what it did not create: consolidation writes only into a new, empty or
earlier neuron-flows output directory, and the flow's rollback removes only such a directory."""

import subprocess
import sys
from pathlib import Path

import pytest

from neuron_flows.tasks.config import FinetuneConfig
from neuron_flows.tasks.consolidate import _remove_consolidated
from neuron_parallel.checkpoint import export_checkpoint
from neuron_parallel.checkpoint.output import is_ours

CKPT = Path(__file__).resolve().parents[1] / "fixtures" / "optimum-neuron" / "ckpt_tp2_base"


def _users_folder(path: Path) -> dict[str, bytes]:
    """A folder of someone else's files, such as a base model directory."""
    path.mkdir(parents=True)
    files = {"model.safetensors": b"the user's weights", "model.safetensors.index.json": b"{}", "notes.txt": b"mine"}
    for name, data in files.items():
        (path / name).write_bytes(data)
    return files


def _contents(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in path.iterdir()}


def test_consolidating_into_a_folder_of_other_files_is_refused_and_changes_nothing(tmp_path):
    files = _users_folder(tmp_path / "base-model")
    with pytest.raises(ValueError, match="did not write"):
        export_checkpoint(CKPT, tmp_path / "base-model")
    assert _contents(tmp_path / "base-model") == files


def test_a_new_or_earlier_output_is_written_and_marked(tmp_path):
    out = export_checkpoint(CKPT, tmp_path / "hf")
    assert is_ours(out) and (out / "model.safetensors").is_file()
    first = (out / "model.safetensors").read_bytes()
    assert export_checkpoint(CKPT, out) == out  # a retry writes over its own output
    assert (out / "model.safetensors").read_bytes() == first
    (tmp_path / "empty").mkdir()
    assert is_ours(export_checkpoint(CKPT, tmp_path / "empty"))


def test_the_cli_refuses_with_exit_2_and_no_traceback(tmp_path):
    files = _users_folder(tmp_path / "models")
    cmd = [sys.executable, "-m", "neuron_flows.flows.cli", "consolidate", str(CKPT), str(tmp_path / "models")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "did not write" in proc.stderr
    assert _contents(tmp_path / "models") == files


class _Txn:
    def __init__(self, path):
        self.values = {"model_dir": str(path)}

    def get(self, key, default=None):
        return self.values.get(key, default)


def test_the_rollback_removes_only_a_directory_neuron_flows_wrote(tmp_path):
    files = _users_folder(tmp_path / "users")
    _remove_consolidated(_Txn(tmp_path / "users"))
    assert _contents(tmp_path / "users") == files
    ours = export_checkpoint(CKPT, tmp_path / "ours")
    _remove_consolidated(_Txn(ours))
    assert not ours.exists()


def test_a_config_naming_a_foreign_consolidated_dir_is_refused_at_load(tmp_path):
    _users_folder(tmp_path / "base")
    with pytest.raises(ValueError, match="output.consolidated_dir"):
        FinetuneConfig.load(None, [f"output.consolidated_dir={tmp_path / 'base'}"])
