"""Processes of this machine: start a child that does not outlive its parent, read what ``/proc``
says of a process (its descendants, whether it runs, when it started, its command line, its
environment) and end a process with everything it started. Linux reads ``/proc``; elsewhere the
readers see nothing.

A pid names a process only while it runs: once it has exited and been reaped, the kernel may give
the number to a new process. So a process recorded to be signalled later is recorded as its pid
and its start time (:func:`identify`), and is signalled only if the pid still has that start time
(:func:`signal_same`); one that has gone is skipped, whoever holds its pid now.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None
_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> Callable[[], None] | None:
    """A ``preexec_fn`` for a child that must not outlive this process, or None where the kernel
    has no parent-death signal (Linux only). The child gets SIGTERM when the thread that started
    it ends, however it ends, SIGKILL included; a parent already gone by the time the child runs
    the call is caught by comparing ``parent_pid``. The C library is loaded here, before the
    fork, so between fork and exec the child makes only the one foreign call."""
    if _LIBC is None:
        return None

    def preexec() -> None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent_pid:
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


def _stat(pid: int | str) -> list[str]:
    """The fields of ``/proc/PID/stat`` after the command name (state first, then ppid, ...).
    The name is in parentheses and may hold spaces, so the fields start after its last ``)``.
    Raises OSError or IndexError for a process that is gone or unreadable."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def _pids() -> list[int]:
    """Every process id ``/proc`` lists; none where ``/proc`` is absent."""
    return [int(e.name) for e in os.scandir("/proc") if e.name.isdigit()] if os.path.isdir("/proc") else []


def start_time(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks after boot (field 22 of ``/proc/PID/stat``);
    None when it is gone or cannot be read. With its pid it names one process for good: a process
    that reuses the pid later starts later."""
    try:
        return int(_stat(pid)[19])
    except (OSError, IndexError, ValueError):
        return None


def identify(pids: Iterable[int]) -> list[tuple[int, int]]:
    """``(pid, start time)`` of each of ``pids`` that is still there, to signal later with
    :func:`signal_same`."""
    return [(pid, started) for pid in pids if (started := start_time(pid)) is not None]


def signal_same(pid: int, started: int, sig: int) -> bool:
    """Send ``sig`` to ``pid`` only if it is still the process that started at ``started`` (see
    :func:`identify`), not one that was given its pid since; whether it was sent. Through a pidfd
    where the kernel has them, so the process checked is the one signalled even if it exits in
    between."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return False
    except (AttributeError, OSError):  # no pidfd here (not Linux, or a kernel before 5.3)
        fd = None
    try:
        if start_time(pid) != started:
            return False
        if fd is None:
            os.kill(pid, sig)
        else:
            signal.pidfd_send_signal(fd, sig)
        return True
    except ProcessLookupError:
        return False
    finally:
        if fd is not None:
            os.close(fd)


def signal_group(pgid: int, started: int | None, sig: int) -> bool:
    """Send ``sig`` to process group ``pgid``, the group of a leader that started at ``started``
    (None where ``/proc`` is absent) and may have exited since; whether it was sent. The kernel
    keeps a pid from new processes while a group still has that id, so a process that holds the
    pid now with another start time means the old group is empty and a new process took the
    number: nothing is sent."""
    now = start_time(pgid)
    if now is not None and now != started:
        return False
    try:
        os.killpg(pgid, sig)
        return True
    except ProcessLookupError:
        return False


def running(pid: int, started: int) -> bool:
    """Whether the process ``pid`` that started at ``started`` is still running (not exited)."""
    return start_time(pid) == started and alive(pid)


def end_processes(procs: list[tuple[int, int]], grace_s: float = 5.0) -> None:
    """End the processes ``procs`` (:func:`identify`): SIGTERM, then SIGKILL to those still running
    ``grace_s`` later; one whose pid another process holds by then is left alone."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid, started in procs:
            signal_same(pid, started, sig)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(running(pid, started) for pid, started in procs):
            time.sleep(0.1)


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants, from /proc (Linux); just ``pid`` where /proc is absent."""
    children: dict[int, list[int]] = {}
    for child in _pids():
        try:
            ppid = int(_stat(child)[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(child)
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(children.get(p, []))
    return tree


def alive(pid: int) -> bool:
    """Whether process ``pid`` is running: it exists and has not exited (a zombie, waiting to be
    reaped, has), from /proc (Linux)."""
    try:
        return _stat(pid)[0] != "Z"
    except (OSError, IndexError):
        return False


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")


def cmdline(pid: int) -> str:
    """The command line of ``pid``, its arguments joined by spaces; empty when it cannot be read
    (the process is gone, is another user's, or has exited: a zombie's is empty)."""
    try:
        return _cmdline(pid)
    except OSError:
        return ""


def processes() -> list[tuple[int, int, str, dict[str, str]]]:
    """(pid, start time, command line, environment) of every live process of this user but this
    one (Linux); the start time is read before the rest, and checked again after, so all of a
    tuple is of one process."""
    out = []
    for pid in _pids():
        if pid == os.getpid():
            continue
        try:
            stat = _stat(pid)
            if stat[0] == "Z":
                continue  # exited already, waiting to be reaped
            cmd = _cmdline(pid)
            raw = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
            started = int(stat[19])
        except (OSError, IndexError, ValueError):  # gone meanwhile, or another user's
            continue
        if start_time(pid) != started:  # the pid was given to another process while it was read
            continue
        out.append((pid, started, cmd, dict(kv.split("=", 1) for kv in raw.split("\0") if "=" in kv)))
    return out


def kill_tree(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """End ``proc`` and everything it started. torchrun (torch 2.13) starts each rank in a
    session of its own, so signalling torchrun's process group does not reach the ranks: SIGTERM
    goes to ``proc``'s process group (torchrun forwards it to the ranks); whatever is left after
    ``grace_s`` is SIGKILLed by pid, from a list of descendants (with their start times) taken
    before anything was signalled: one that exited meanwhile is skipped, even if its pid was given
    to another process since (:func:`signal_same`). Returns once those killed have exited (up to
    ``grace_s`` more)."""
    if proc.poll() is not None:
        return
    tree = identify(process_tree(proc.pid))
    try:  # not reaped yet (poll said so), so its pid, and its group's id, are still its own
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    killed = [pid for pid, started in tree if signal_same(pid, started, signal.SIGKILL)]
    if proc.poll() is None:  # Popen signals only a child it has not reaped; also where /proc is absent
        proc.kill()
    proc.wait()
    # SIGKILL is delivered at once but a process takes a moment to exit (its memory unmapped):
    # wait for it, so that nothing this returns from still runs.
    deadline = time.monotonic() + grace_s
    while any(alive(pid) for pid in killed) and time.monotonic() < deadline:
        time.sleep(0.01)
