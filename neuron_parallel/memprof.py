"""Peak tensor memory of a CPU process, measured from the allocator itself.

CPU tensors have no allocator statistics like ``torch.cuda.max_memory_allocated``, and process
RSS mixes in the interpreter, libraries, memory-mapped datasets and freed-but-cached pages. With
``torch.profiler.profile(profile_memory=True)``, c10's CPU allocator reports every tensor storage
allocation and free with its size and the running total of bytes allocated since profiling
began; the peak of that running total is the process's peak tensor memory (memory that gloo or
Python allocate outside tensors is not counted).

One catch: the allocator keeps that total only in threads the profiler watches, and gloo's worker
threads release some tensors, so their frees go missing and the total drifts upward (~15 % in a
tp=2 run). c10's ``caffe2_report_cpu_memory_usage`` flag makes it count in every thread; it has
no Python setter, so ``track_all_threads`` sets it through ctypes. ``check_method`` verifies the
whole method on a known allocation pattern, including a free in another thread.

    with TensorMemoryProfile() as probe:
        ...                                   # with record_function("phase:save"): ...
    probe.peak(exclude=("save",))             # bytes

On accelerators use the device allocator's own statistics instead; this module is for CPU.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import threading
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from .mesh import local_device

PHASE_PREFIX = "phase:"
"""``record_function`` ranges named ``phase:<name>`` label where a peak fell."""


def track_all_threads() -> None:
    """Make c10's CPU allocator keep its byte count in every thread (see the module docstring)."""
    lib = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libc10.so"))
    ctypes.c_bool.in_dll(lib, "FLAGS_caffe2_report_cpu_memory_usage").value = True


class TensorMemoryProfile:
    """Context manager: profile CPU tensor allocations; ``peak()`` afterwards."""

    def __init__(self) -> None:
        self._prof = None
        self.events: list[tuple[int, int]] = []
        self.ranges: list[tuple[int, int, str]] = []

    def __enter__(self) -> TensorMemoryProfile:
        track_all_threads()
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._prof.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._prof.__exit__(*exc)
        if exc[0] is None:
            self.events, self.ranges = _allocations(self._prof)

    def peak(self, exclude: tuple[str, ...] = ()) -> dict:
        """``{"peak": bytes, "phase": name, "phases": {name: bytes}}``: the largest running total
        of allocated tensor bytes, over all events outside the ``exclude`` phases."""
        starts = [r[0] for r in self.ranges]
        peak, at, phases = 0, "other", {}
        for t, total in self.events:
            i = bisect.bisect_right(starts, t) - 1
            name = self.ranges[i][2] if i >= 0 and t <= self.ranges[i][1] else "other"
            phases[name] = max(phases.get(name, 0), total)
            if name not in exclude and total > peak:
                peak, at = total, name
        return {"peak": peak, "phase": at, "phases": phases}


def _allocations(prof) -> tuple[list[tuple[int, int]], list[tuple[int, int, str]]]:
    """(time ns, bytes allocated so far) for every CPU allocation/free, and the phase ranges."""
    from torch._C._profiler import _EventType

    out, ranges, stack = [], [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.tag == _EventType.Allocation and str(node.extra_fields.device) == "cpu":
            out.append((node.start_time_ns, node.extra_fields.total_allocated))
        elif node.name.startswith(PHASE_PREFIX):
            ranges.append((node.start_time_ns, node.end_time_ns, node.name[len(PHASE_PREFIX) :]))
    return sorted(out), sorted(ranges)


def check_method() -> int:
    """The measurement on a known pattern: allocate 100 MB + 50 MB, free the 100, hold 10 MB,
    a 50 MB temporary, free the 10 MB in another thread. The peak must read exactly 150 MB and
    the end the 1 MB still held; raises ``RuntimeError`` otherwise."""
    with TensorMemoryProfile() as probe:
        a = torch.empty(25_000_000)
        b = torch.ones(12_500_000)
        del a
        held = [torch.zeros(2_500_000)]
        (b * 2).sum()  # 50 + 10 + 50 = 110 MB, below the 150 MB peak
        worker = threading.Thread(target=held.clear)
        worker.start()
        worker.join()
        keep = torch.ones(250_000)
        del b
    peak, last = probe.peak()["peak"], probe.events[-1][1]
    del keep
    if peak != 150_000_000 or last != 1_000_000:
        raise RuntimeError(
            f"tensor memory measurement reads peak {peak} and final {last} bytes on a pattern of "
            "150 000 000 and 1 000 000; it is not trustworthy with this torch build"
        )
    return peak


class RankMemoryProbe:
    """Peak tensor memory of this rank, on any device: :class:`TensorMemoryProfile` on CPU (with
    phases ``phase(name)`` that ``peak`` can leave out), the device allocator's peak elsewhere
    (phases are then not told apart). After the ``with`` block, ``measured`` is
    ``{"peak": bytes, "phase": where the peak fell}``."""

    def __init__(self, device: str, exclude: tuple[str, ...] = ()) -> None:
        self.device = device
        self.cpu = TensorMemoryProfile() if device == "cpu" else None
        self.exclude = exclude
        self.measured: dict = {}

    def __enter__(self) -> RankMemoryProbe:
        if self.cpu:
            self.cpu.__enter__()
        else:
            # This rank's own device: before the engine selects it, the current device is index 0
            # on every rank, and touching it would open a context on the first device per rank.
            torch.accelerator.reset_peak_memory_stats(local_device(self.device).index)
        return self

    def __exit__(self, *exc) -> None:
        if self.cpu:
            self.cpu.__exit__(*exc)
            self.measured = self.cpu.peak(exclude=self.exclude)
        else:
            peak = torch.accelerator.max_memory_allocated(local_device(self.device).index)
            self.measured = {"peak": peak, "phase": "all (device allocator)"}

    def phase(self, name: str):
        """A context labelling what runs inside it as phase ``name`` (CPU only)."""
        if self.cpu:
            return torch.profiler.record_function(PHASE_PREFIX + name)
        return contextlib.nullcontext()
