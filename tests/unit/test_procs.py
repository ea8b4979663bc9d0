"""Clean-up signals only the processes it recorded: a pid is recorded with its start time, and a
pid that has another start time by the time it is signalled (it was given to a new process) is
left alone. Real processes throughout; a reused pid is stood in for by a live process recorded
under a start time it does not have, which is exactly what a reused pid looks like."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from neuron_parallel import procs
from neuron_parallel.procs import (
    alive,
    end_processes,
    identify,
    kill_tree,
    processes,
    signal_group,
    signal_same,
    start_time,
)

pytestmark = pytest.mark.timeout(60)

SLEEP = [sys.executable, "-c", "import time; time.sleep(60)"]
IGNORES_SIGTERM = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True); time.sleep(60)"
)


@pytest.fixture
def bystander():
    """A process this test's clean-up must not touch; ended by the fixture itself."""
    proc = subprocess.Popen(SLEEP, start_new_session=True)
    yield proc
    proc.kill()
    proc.wait()


def _wait_gone(proc: subprocess.Popen, timeout: float = 10.0) -> int | None:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None


def test_start_time_is_field_22_of_proc_stat_and_stays_with_the_process(bystander):
    started = start_time(bystander.pid)
    with open(f"/proc/{bystander.pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    assert started == int(fields[19]) and started > 0
    assert start_time(os.getpid()) < started  # this process started first
    assert identify([bystander.pid]) == [(bystander.pid, started)]
    assert (bystander.pid, started) in [(pid, t) for pid, t, _, _ in processes()]


def test_a_pid_recorded_with_another_start_time_is_not_signalled(bystander):
    started = start_time(bystander.pid)
    assert not signal_same(bystander.pid, started + 1, signal.SIGKILL)
    assert _wait_gone(bystander, 0.5) is None and alive(bystander.pid)
    assert signal_same(bystander.pid, started, signal.SIGKILL)  # the process it was recorded as
    assert _wait_gone(bystander) == -signal.SIGKILL


def test_a_child_that_exited_and_was_reaped_is_skipped(bystander):
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    recorded = identify([child.pid])
    assert child.wait(timeout=30) == 0  # reaped: its pid is free for any new process
    assert start_time(child.pid) is None or start_time(child.pid) != recorded[0][1]
    assert not signal_same(*recorded[0], signal.SIGKILL)
    # Clean-up over the exited child and a reused pid (the bystander under a start time it never
    # had) sends nothing to the bystander, and returns at once: nothing it recorded is running.
    t0 = time.monotonic()
    end_processes([*recorded, (bystander.pid, start_time(bystander.pid) - 1)], grace_s=5.0)
    assert time.monotonic() - t0 < 5.0
    assert bystander.poll() is None and alive(bystander.pid)


def test_end_processes_ends_what_it_recorded_sigkill_after_the_grace_for_one_that_ignores_sigterm(bystander):
    stubborn = subprocess.Popen([sys.executable, "-c", IGNORES_SIGTERM], stdout=subprocess.PIPE)
    polite = subprocess.Popen(SLEEP)
    assert stubborn.stdout.readline().strip() == b"1"  # its SIGTERM handler is in place
    end_processes(identify([stubborn.pid, polite.pid]) + [(bystander.pid, 0)], grace_s=0.5)
    assert _wait_gone(polite) == -signal.SIGTERM and _wait_gone(stubborn) == -signal.SIGKILL
    assert bystander.poll() is None


def test_kill_tree_ends_the_tree_but_not_a_pid_recorded_in_it_that_now_names_another_process(monkeypatch, bystander):
    # The tree: a session leader whose child ignores SIGTERM, so the SIGKILL step is what ends it.
    code = (
        f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {IGNORES_SIGTERM!r}]); time.sleep(60)"
    )
    root = subprocess.Popen([sys.executable, "-c", code], start_new_session=True, stdout=subprocess.PIPE)
    assert root.stdout.readline().strip() == b"1"
    tree = procs.process_tree(root.pid)
    assert len(tree) == 2
    child = next(pid for pid in tree if pid != root.pid)
    child_started = start_time(child)
    real_identify = procs.identify
    # As if the bystander's pid had been recorded in the tree by an earlier holder of that pid.
    monkeypatch.setattr(
        procs, "identify", lambda pids: [*real_identify(pids), (bystander.pid, start_time(bystander.pid) + 7)]
    )
    kill_tree(root, grace_s=0.5)
    assert root.returncode == -signal.SIGTERM
    deadline = time.monotonic() + 10
    while start_time(child) == child_started and alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not (start_time(child) == child_started and alive(child)), "the child ignoring SIGTERM survived"
    assert bystander.poll() is None and alive(bystander.pid)


def test_signal_group_reaches_a_group_whose_leader_exited_but_not_a_pid_with_another_start_time(bystander):
    # The leader starts a member in its own group and exits; serve restarts a dead child this way.
    leader = subprocess.Popen(
        [sys.executable, "-c", f"import subprocess; print(subprocess.Popen({SLEEP!r}).pid, flush=True)"],
        start_new_session=True,
        stdout=subprocess.PIPE,
    )
    leader_started = start_time(leader.pid)
    member = int(leader.stdout.readline())
    assert leader.wait(timeout=30) == 0 and alive(member)
    assert not signal_group(bystander.pid, start_time(bystander.pid) - 1, signal.SIGKILL)  # a reused number
    assert bystander.poll() is None
    assert signal_group(leader.pid, leader_started, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while alive(member) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(member)


def test_serve_ends_the_leftovers_of_its_own_runs_only(bystander):
    from neuron_flows.flows.serve import RUN_ID_ENV, SERVE_ID_ENV, end_orphans

    def run_process(serve_id: str) -> subprocess.Popen:
        env = {**os.environ, RUN_ID_ENV: "run-1", SERVE_ID_ENV: serve_id}
        return subprocess.Popen(SLEEP, env=env, start_new_session=True)

    ours, theirs = run_process("serve-a"), run_process("serve-b")
    try:
        deadline = time.monotonic() + 10  # the environment is readable once the interpreter runs
        while ours.pid not in [pid for pid, *_ in processes()] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert end_orphans("serve-a") == [ours.pid]  # a rank with no flow-run process left
        assert _wait_gone(ours) == -signal.SIGTERM
        assert theirs.poll() is None and bystander.poll() is None
    finally:
        for proc in (ours, theirs):
            proc.kill()
            proc.wait()
