"""The ``neuron-flows`` command run in the test process (where the test's Prefect server and
settings apply), its signal handlers restored afterwards."""

from __future__ import annotations

import contextlib
import io
import signal


def run_cli(*args: str) -> tuple[int, str]:
    """``neuron-flows ARGS`` through the CLI's entry point in this process: its exit code and stdout."""
    from neuron_flows.flows.cli import main

    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)}
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            code = main(list(args))
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    return code, out.getvalue()
