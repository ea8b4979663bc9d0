"""The command line starts light: its help and a refused config import neither torch,
transformers, datasets nor Prefect (so no Prefect server is started for a config that cannot run)."""

import subprocess
import sys

from ..conftest import ROOT

PROBE = """
import sys
from neuron_flows.flows.cli import main
try:
    main(["--help"])
except SystemExit:
    pass
code = main(["run", sys.argv[1], "--set", "parallel.tp=3"])
heavy = sorted(m for m in ("torch", "transformers", "datasets", "prefect") if m in sys.modules)
print("probe", code, ",".join(heavy) or "-")
"""


def test_help_and_a_refused_config_import_nothing_heavy():
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, str(ROOT / "configs" / "tiny-llama-cpu.yaml")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "usage: neuron-flows" in proc.stdout
    assert proc.stdout.splitlines()[-1] == "probe 2 -", proc.stdout[-2000:] + proc.stderr
    assert proc.stderr.startswith("error: invalid config: world size 2"), proc.stderr


FLOW_PROBE = """
import sys
import neuron_flows.flows.cli, neuron_flows.flows.finetune
heavy = ("torch.distributed.tensor", "torch.distributed.pipelining", "torch._dynamo", "transformers")
heavy += ("prefect.server.api",)
print("probe", ",".join(sorted(m for m in heavy if m in sys.modules)) or "-")
"""


def test_the_flow_imports_neither_the_trainer_nor_the_server():
    """What `neuron-flows run` imports to run the flow: the training code (DTensor, pipelining,
    transformers' models) belongs to the ranks and the server code to the server's process; each
    costs seconds of CPU while the server and the ranks start on the same cores."""
    proc = subprocess.run([sys.executable, "-c", FLOW_PROBE], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "probe -", proc.stdout[-2000:]
