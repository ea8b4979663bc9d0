"""Consolidation in one pass over the piece files: each file read once, front to back, hashed as
it is read, and every piece's bytes written straight to where the exported tensor keeps them in
the output file.

Hashing a file and then reading its pieces would read every byte twice (from disk twice once a
checkpoint outgrows the page cache), and assembling a column-split tensor in memory before
writing it adds a copy and a buffer the size of the tensor. Here a file's bytes go from one read
buffer to the hash and on to their output offsets: ``pwrite`` for a piece of whole rows (one
contiguous range of the output), and for a piece holding a range of columns, whose rows are
strided in the output, a strided copy into a memory map of the output rows it touches. Files are
passed in parallel threads (file reads, ``hashlib`` and ``pwrite`` release the GIL). Memory stays
at one read buffer and one output window per thread, whatever the tensor sizes.

The output header is written first, so every tensor's place is known and the file fills in
whatever order the pieces arrive. A file's digest is known only at the end of its pass: callers
keep the output under a temporary name until :func:`scatter_pieces` has returned and the digests
are checked.
"""

from __future__ import annotations

import hashlib
import math
import mmap
import os
import threading
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import torch

from .format import Piece
from .tensors import CheckpointTensors

BLOCK_BYTES = 16 << 20
"""Bytes read (and hashed, and written) per step of a file's pass, per thread."""
MAX_THREADS = 4
"""Files passed at once: enough to keep a disk and the hashing busy on a few cores."""


@dataclass(frozen=True, slots=True)
class Target:
    """Where an exported tensor goes: an output file opened for reading and writing, the offset
    of the tensor's first byte in it, the exported shape and the bytes per element."""

    fd: int
    offset: int
    shape: tuple[int, ...]
    itemsize: int

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape[1:]) * self.itemsize


@dataclass(frozen=True, slots=True)
class _Span:
    """Bytes of a piece file that go to the output: ``nbytes`` from ``begin``, handed on in
    chunks of at most ``chunk`` bytes (whole piece rows, for a piece holding a range of columns)
    to ``write(at, data)``, ``at`` counting bytes from ``begin``."""

    begin: int
    nbytes: int
    chunk: int
    write: Callable[[int, memoryview], None]


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def write_behind(fd: int, data: memoryview, offset: int) -> None:
    """Write a range no other piece shares, and start its writeback now: on Linux,
    ``POSIX_FADV_DONTNEED`` first hands the range's dirty pages to the disk without waiting
    (then drops those already clean), so the disk writes while the pass goes on and the final
    fsync waits for the tail alone; the pages also leave the page cache once written."""
    _pwrite_all(fd, data, offset)
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, offset, len(data), os.POSIX_FADV_DONTNEED)


def box_writer(target: Target, offsets: list[int], shape: list[int]) -> Callable[[int, memoryview], None]:
    """Rows of a piece that holds a sub-range of the inner dims: each chunk of whole piece rows is
    copied into a memory map of the output rows it lands in (page-aligned, closed after the copy,
    so mapped memory stays at one window)."""
    isz, out_row = target.itemsize, target.row_bytes
    piece_row = math.prod(shape[1:]) * isz
    inner = tuple(slice(o, o + n) for o, n in zip(offsets[1:-1], shape[1:-1]))
    last = slice(offsets[-1] * isz, (offsets[-1] + shape[-1]) * isz)

    def write(at: int, data: memoryview) -> None:
        row, rows = at // piece_row, len(data) // piece_row
        start = target.offset + (offsets[0] + row) * out_row
        stop = start + rows * out_row
        base = start - start % mmap.ALLOCATIONGRANULARITY
        with mmap.mmap(target.fd, stop - base, offset=base) as window:
            out = torch.frombuffer(window, dtype=torch.uint8, count=stop - start, offset=start - base)
            out = out.view(rows, *target.shape[1:-1], target.shape[-1] * isz)
            src = torch.frombuffer(data, dtype=torch.uint8).view(rows, *shape[1:-1], shape[-1] * isz)
            out[(slice(None), *inner, last)] = src
            del out, src  # the window cannot close while a tensor still views it

    return write


def _span(begin: int, target: Target, piece: Piece) -> _Span:
    """The kept bytes of ``piece`` (stored from file offset ``begin``) and how they reach
    ``target``. Rows past the exported shape (a padded vocabulary) are not kept."""
    isz = target.itemsize
    if not target.shape:
        return _Span(begin, isz, BLOCK_BYTES, lambda at, data: _pwrite_all(target.fd, data, target.offset + at))
    piece_row = math.prod(piece.shape[1:]) * isz
    rows = min(piece.shape[0], target.shape[0] - piece.offsets[0])
    if list(piece.shape[1:]) == list(target.shape[1:]):  # whole rows: one contiguous output range
        dst = target.offset + piece.offsets[0] * target.row_bytes
        return _Span(begin, rows * piece_row, BLOCK_BYTES, lambda at, data: write_behind(target.fd, data, dst + at))
    chunk = max(1, BLOCK_BYTES // max(1, target.row_bytes)) * piece_row
    return _Span(begin, rows * piece_row, chunk, box_writer(target, piece.offsets, piece.shape))


def plan_spans(tensors: CheckpointTensors, targets: dict[str, Target]) -> dict[str, list[_Span]]:
    """Per piece file (by its manifest name), the spans it sends to ``targets``, in file order.
    Refuses a plan whose pieces would not fill every target byte exactly, or that reads the same
    stored bytes for two pieces (quick validation has already checked that the pieces cover each
    tensor once; these are the last guards against leaving zeros in a sparse output file)."""
    spans: dict[str, list[_Span]] = {}
    for name, target in targets.items():
        filled = 0
        for piece in tensors.pieces(name):
            if target.shape and piece.offsets[0] >= target.shape[0]:
                continue  # padding rows beyond the exported vocabulary
            begin = tensors.piece_start(name, piece)
            span = _span(begin, target, piece)
            spans.setdefault(piece.file, []).append(span)
            filled += span.nbytes
        if filled != math.prod(target.shape) * target.itemsize:
            raise ValueError(
                f"{tensors.root}: the pieces of {name} fill {filled} of its "
                f"{math.prod(target.shape) * target.itemsize} bytes; run neuron-flows validate {tensors.root}"
            )
    for rel, file_spans in spans.items():
        file_spans.sort(key=lambda s: s.begin)
        for a, b in zip(file_spans, file_spans[1:]):
            if b.begin < a.begin + a.nbytes:  # one pass reads each byte once, for one place
                raise ValueError(
                    f"{tensors.file_path(rel)}: the manifest gives the bytes from offset {b.begin} to two pieces; "
                    f"run neuron-flows validate {tensors.root}"
                )
    return spans


class _Stopped(Exception):
    """Another file's pass failed: this one ends early."""


def _pass(path: Path, spans: list[_Span], stop: threading.Event) -> str:
    """Read ``path`` front to back; hash every byte, send the spans' bytes on. Returns the sha256."""
    digest = hashlib.sha256()
    buf = memoryview(bytearray(max([BLOCK_BYTES] + [s.chunk for s in spans])))
    with open(path, "rb", buffering=0) as f:
        pos = 0

        def take(end: int, span: _Span | None = None) -> None:
            nonlocal pos
            while pos < end:
                if stop.is_set():
                    raise _Stopped
                view = buf[: min(end - pos, span.chunk if span else len(buf))]
                got = 0
                while got < len(view):  # readinto may return short counts on large reads
                    n = f.readinto(view[got:])
                    if not n:
                        raise ValueError(f"{path}: ends at byte {pos + got}, before its tensors do (truncated file)")
                    got += n
                digest.update(view)
                if span is not None:
                    span.write(pos - span.begin, view)
                pos += len(view)

        for span in spans:
            take(span.begin)
            take(span.begin + span.nbytes, span)
        take(os.fstat(f.fileno()).st_size)
    return digest.hexdigest()


def scatter_pieces(tensors: CheckpointTensors, targets: dict[str, Target]) -> dict[str, str]:
    """Write every tensor of ``targets`` from its pieces, one pass per piece file, files in
    parallel. Returns the sha256 of each file read (by manifest name), for the caller to check
    before the output is put in place. The first failure ends the other passes at their next
    block and is raised."""
    spans = plan_spans(tensors, targets)
    stop = threading.Event()
    workers = max(1, min(MAX_THREADS, os.cpu_count() or 1, len(spans)))
    with ThreadPoolExecutor(workers, thread_name_prefix="consolidate") as pool:
        futures = {rel: pool.submit(_pass, tensors.file_path(rel), s, stop) for rel, s in spans.items()}
        try:
            wait(futures.values(), return_when=FIRST_EXCEPTION)
        finally:  # all done, or one failed (or an interrupt): the others stop at their next block
            stop.set()
    errors = [f.exception() for f in futures.values() if f.exception() and not isinstance(f.exception(), _Stopped)]
    if errors:
        raise errors[0]
    return {rel: f.result() for rel, f in futures.items()}
