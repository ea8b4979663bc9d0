"""`pip install .` into a fresh virtual environment: the distribution claims `neuron_parallel`
and `neuron_flows` only (not the generic `tasks` and `flows`), and `neuron-flows --help` works."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_pip_install_claims_no_generic_top_level_names(tmp_path):
    fresh = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(fresh)], check=True)
    python = fresh / "bin" / "python"
    # The wheel is built here (setuptools, a test dependency) and installed with --no-deps: the
    # dependencies are this environment's (put on PYTHONPATH below); what is under test is what
    # the project's own files install.
    pip = [sys.executable, "-m", "pip"]
    src = tmp_path / "src"  # a copy, so the build leaves nothing in the checkout
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", ".venv", ".runs", ".tiny", "build", "*.egg-info"))
    subprocess.run(
        [*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", tmp_path / "dist", src],
        check=True,
        cwd=tmp_path,
    )
    wheel = next((tmp_path / "dist").glob("neuron_flows-*.whl"))
    subprocess.run([*pip, "--python", python, "install", "-q", "--no-deps", wheel], check=True, cwd=tmp_path)
    site = Path(
        subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    installed = {
        p.name for p in site.iterdir() if not p.name.endswith((".dist-info", ".pth")) and p.name != "__pycache__"
    }
    assert {"neuron_parallel", "neuron_flows"} <= installed
    assert not installed & {"tasks", "flows"}, installed
    assert (site / "neuron_flows" / "tasks" / "config.py").is_file()
    env = {**os.environ, "PYTHONPATH": sysconfig.get_paths()["purelib"]}  # dependencies only
    probe = subprocess.run(
        [python, "-c", "import neuron_flows.flows.cli, neuron_flows.tasks.config as c; print(c.__file__)"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.startswith(str(site)), probe.stdout  # the installed copy, not the checkout
    for generic in ("tasks", "flows"):
        gone = subprocess.run(
            [python, "-c", f"import {generic}"], capture_output=True, text=True, env=env, cwd=tmp_path
        )
        assert gone.returncode != 0 and "ModuleNotFoundError" in gone.stderr
    cli = subprocess.run(
        [fresh / "bin" / "neuron-flows", "--help"], capture_output=True, text=True, env=env, cwd=tmp_path
    )
    assert cli.returncode == 0, cli.stderr
    assert "run" in cli.stdout and "consolidate" in cli.stdout
