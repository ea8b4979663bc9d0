"""Processes of this machine: start a child that does not outlive its parent, read what ``/proc``
says of a process (its descendants, whether it runs, its command line, its environment) and end
a process with everything it started. Linux reads ``/proc``; elsewhere the readers see nothing.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Callable
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


def processes() -> list[tuple[int, str, dict[str, str]]]:
    """(pid, command line, environment) of every live process of this user but this one (Linux)."""
    out = []
    for pid in _pids():
        if pid == os.getpid():
            continue
        try:
            if _stat(pid)[0] == "Z":
                continue  # exited already, waiting to be reaped
            cmd = _cmdline(pid)
            raw = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
        except (OSError, IndexError):  # gone meanwhile, or another user's
            continue
        out.append((pid, cmd, dict(kv.split("=", 1) for kv in raw.split("\0") if "=" in kv)))
    return out


def kill_tree(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """End ``proc`` and everything it started. torchrun (torch 2.13) starts each rank in a
    session of its own, so signalling torchrun's process group does not reach the ranks: SIGTERM
    goes to ``proc``'s process group (torchrun forwards it to the ranks); whatever is left after
    ``grace_s`` is SIGKILLed by pid, from a list of descendants taken before anything was
    signalled."""
    if proc.poll() is not None:
        return
    tree = process_tree(proc.pid)
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()
