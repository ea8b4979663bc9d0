"""Small helpers shared across the library (no torch import: the planner uses them too)."""

from __future__ import annotations

import gc
import hashlib
import json
import math
import os
import stat
import sys
from contextlib import contextmanager
from pathlib import Path

DEVICE_BACKENDS = {"cpu": "gloo", "cuda": "nccl", "neuron": "neuron"}
"""The torch.distributed backend of each device type."""


def names_local_path(name: str) -> bool:
    """Whether ``name`` can only be a local path, never a Hub repo id (``name`` or ``org/name``):
    it starts with ``/``, ``.`` or ``~``, or has more than one ``/``."""
    return name.startswith(("/", ".", "~")) or name.count("/") > 1


def check_choice(section: str, name: str, value: object, choices: tuple) -> None:
    """Refuse a config value outside its ``choices``, naming the key and the valid values."""
    if value not in choices:
        raise ValueError(f"{section}.{name}={value!r} is not one of {choices}")


def divisors(n: int) -> list[int]:
    """Every positive divisor of ``n``, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


@contextmanager
def gc_paused():
    """Python's cyclic garbage collector off for the block (as it was after). For batch work that
    allocates many short-lived, acyclic containers (a tokenizing batch's token lists and message
    dicts), which reference counting frees: the collections those allocations trigger would
    otherwise reach the oldest generation now and then and scan every object of the process
    (hundreds of thousands once torch and transformers are imported), a large share of the batch's
    time."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def usable_cores() -> int:
    """The cores this process may run on (its affinity where the platform tells it)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


@contextmanager
def small_pages():
    """NumPy's huge-page advice off for the block (as it was after). NumPy advises the kernel to
    back every array of 4 MiB or more with 2 MiB pages (``madvise(MADV_HUGEPAGE)``). Where
    transparent huge pages are ``madvise`` for both enabling and defragmenting (the default of
    Ubuntu and Amazon Linux, say), the first touch of such an array waits while the kernel zeroes,
    or compacts memory to assemble, a whole 2 MiB page. Tokenizing writes large arrays once and
    reads them once (packed rows, flat token ids), so it gains nothing from huge pages' fewer TLB
    misses and pays that wait: on the 2-core benchmark host, filling fresh arrays took 3 to 6 ms
    per MB with the advice and 0.4 without, and the preference pack step 0.3 to 0.5 s against 0.07
    to 0.14 s. The switch is NumPy's own (``_set_madvise_hugepage``, what the documented
    ``NUMPY_MADVISE_HUGEPAGE`` variable sets at import); where this NumPy lacks it, nothing changes."""
    try:
        from numpy._core.multiarray import _set_madvise_hugepage
    except ImportError:
        yield
        return
    was = _set_madvise_hugepage(False)
    try:
        yield
    finally:
        _set_madvise_hugepage(was)


def sha256_file(path: str | Path, chunk: int = 1 << 22) -> str:
    """Hex sha256 of a file, read in ``chunk``-byte pieces."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


MAX_JSON_BYTES = 64 << 20
"""The largest JSON file read from a checkpoint, a model folder or an import (a checkpoint's
manifest, a Hugging Face weight index, a ``config.json``, optimum-neuron metadata, a trainer state):
64 MiB. Generous (the manifest of a 70B model split tp=32 × pp=8 with its optimizer state is a few
MiB; a weight index or a config, kilobytes), while a crafted file cannot make a reader parse
gigabytes."""


def read_json(path: str | Path, limit: int = MAX_JSON_BYTES) -> object:
    """The JSON value the file ``path`` holds. Refused with a ``ValueError`` naming the file when it
    is not a regular file (a FIFO or a device is never read), is larger than ``limit`` bytes, or is
    not UTF-8 JSON; a missing file raises ``FileNotFoundError`` as ``open`` does."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # a FIFO must not block the open
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{path}: not a regular file; a JSON file is expected there")
        # Never more than one byte past the limit, even of a file that grows meanwhile.
        data = f.read(limit + 1) if info.st_size <= limit else b""
    if info.st_size > limit or len(data) > limit:
        raise ValueError(
            f"{path}: {max(info.st_size, len(data))} bytes, more than the {limit} bytes a JSON file of a "
            "checkpoint or model may have; it is not a file this tool reads, or a damaged one: point at "
            "the intended checkpoint or model folder"
        )
    try:
        return json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e}); the file is damaged or not the one expected") from None


def split_layers(num_layers: int, num_stages: int, layer_split: list[int] | None = None) -> list[range]:
    """Layer ranges per stage: the user's split, or as even as possible (earlier stages get the
    extra layers, since the last stage also carries the norm, lm_head and loss)."""
    if layer_split is not None:
        if len(layer_split) != num_stages or sum(layer_split) != num_layers or any(n < 1 for n in layer_split):
            raise ValueError(
                f"parallel.layer_split={layer_split} must be {num_stages} positive counts summing to the "
                f"model's {num_layers} layers"
            )
        counts = list(layer_split)
    else:
        if num_stages > num_layers:
            raise ValueError(
                f"{num_stages} pipeline stages (pp × virtual_stages) exceed the model's {num_layers} layers; "
                f"use pp × virtual_stages <= {num_layers}"
            )
        base, extra = divmod(num_layers, num_stages)
        counts = [base + (1 if i < extra else 0) for i in range(num_stages)]
    ranges, start = [], 0
    for n in counts:
        ranges.append(range(start, start + n))
        start += n
    return ranges


CONTEXT_QUERY_BLOCK = 512
"""Query positions per attention block on the context-parallel path of devices without a
block-sparse kernel (neuron, CPU; ``neuron_parallel.parallel.context``): one block's scores and
mask (``block × S`` per head) exist at a time, in forward and again in backward, which recomputes
them. 512 is the tile of torch-neuronx's flash-attention kernel."""


def context_block_multiple(cp: int, tp: int = 1, sequence_parallel: bool = False) -> int:
    """What ``data.block_size`` must be a multiple of under context parallelism of degree ``cp``:
    ``2·cp`` (each row is cut into 2·cp equal chunks, ``neuron_parallel.parallel.context``), and
    under sequence parallelism also ``cp·tp`` (each rank's S/cp positions split over tp)."""
    if cp == 1:
        return 1
    return math.lcm(2 * cp, cp * tp) if sequence_parallel else 2 * cp


def context_problem(cp: int, block_size: int, tp: int = 1, sequence_parallel: bool = False) -> str | None:
    """Why context parallelism of degree ``cp`` cannot cut rows of ``block_size`` tokens (None when
    it can, :func:`context_block_multiple`): the message names both keys and the values that would do."""
    need = context_block_multiple(cp, tp, sequence_parallel)
    if block_size % need == 0:
        return None
    why = f"2·cp = {2 * cp} equal chunks" + (
        f" whose S/cp positions split over tp={tp} (sequence parallelism)" if sequence_parallel else ""
    )
    valid = [c for c in divisors(block_size) if block_size % context_block_multiple(c, tp, sequence_parallel) == 0]
    return (
        f"data.block_size={block_size} does not split over parallel.cp={cp}: context parallelism cuts each row "
        f"into {why}; use a data.block_size that is a multiple of {need} (e.g. {-(-block_size // need) * need}), "
        f"or parallel.cp in {valid}"
    )


def check_context_split(block_size: int, cp: int, tp: int = 1, sequence_parallel: bool = False) -> None:
    """Refuse (ValueError) a row length the cp sharding cannot cut (:func:`context_problem`)."""
    if problem := context_problem(cp, block_size, tp, sequence_parallel):
        raise ValueError(problem)


def write_line(text: str) -> None:
    """Write ``text`` and a newline to stdout in one ``write`` call. Ranks share one pipe, and a
    pipe write of up to PIPE_BUF (4 KiB) bytes is atomic, so no other rank's output can split the
    line (``print`` may write the text and the newline separately when stdout is unbuffered)."""
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), (text + "\n").encode())


def fsync_path(path: str | Path) -> None:
    """Flush a file's or a directory's data to disk. A directory's fsync makes the names created,
    renamed or removed in it durable: without it a power cut can lose a completed rename."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str | Path, data: str | bytes) -> None:
    """Write ``data`` to ``path`` so that a reader, or a crash at any moment, sees either the old
    file or the whole new one: a temporary file beside it, fsynced, renamed over it, and the
    directory fsynced."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)
