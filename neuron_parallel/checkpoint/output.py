"""Output directories the tool writes into, and may therefore clean or remove.

One rule for every directory the tool writes into (a run's ``output.dir``, an export, the
consolidated model): it is new, empty, or one neuron-flows created (it holds :data:`OWNER_FILE`,
written with the directory's first file). Anything else is refused before a byte is written, with
the fix named, and nothing is removed from a directory that does not carry the marker.

A model that may replace an earlier one (``output.consolidated_dir`` reused across runs) is
written beside it first (:func:`stage_output_dir`) and put in its place only once it is published
(:func:`replace_with_staged`); :func:`discard_staged` drops it and leaves the earlier one as it was.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from ..utils import fsync_path

OWNER_FILE = ".neuron-flows-output"
"""The marker of a directory written by neuron-flows (left out of Hub uploads)."""
STAGING_SUFFIX = ".staging"
"""``<name>.staging/``, beside an output: where its replacement is written (:func:`stage_output_dir`)."""
RUN_DIR_FIX = (
    "or, to continue from an earlier run's checkpoints there, name it in train.resume_from and a new output.dir"
)
"""The other way out of a refused ``output.dir``."""


class OutputDirRefused(ValueError):
    """A directory the tool would write into is a file, or holds files neuron-flows did not write."""


def check_output_dir(path: str | Path, *, key: str | None = None, fix: str | None = None) -> Path:
    """``path`` if the tool may write into it: missing, an empty directory, or one that carries the
    marker; else :class:`OutputDirRefused`. Nothing is created or changed. ``key``: the config key
    that names ``path``, for the message; ``fix``: a further way out the message offers."""
    out = Path(path)
    name = f"{key}={out}" if key else f"the output {out}"
    more = f", {fix}" if fix else ""
    if out.exists() and not out.is_dir():
        raise OutputDirRefused(f"{name} is a file; name a new or empty directory{more}")
    if out.is_dir() and not is_ours(out) and any(out.iterdir()):
        raise OutputDirRefused(
            f"{name} already holds files neuron-flows did not write (there is no {OWNER_FILE} in it); name a new "
            f"or empty directory{more} (nothing there was changed)"
        )
    return out


def claim_output_dir(path: str | Path, *, key: str | None = None, fix: str | None = None) -> Path:
    """``path`` ready to write into (:func:`check_output_dir`): created, with the marker, when
    missing or empty; accepted as it is when it carries the marker."""
    out = check_output_dir(path, key=key, fix=fix)
    out.mkdir(parents=True, exist_ok=True)
    marker = out / OWNER_FILE
    if not marker.exists():
        marker.write_text(json.dumps({"written_by": "neuron-flows"}) + "\n")
    return out


def check_run_dir(path: str | Path) -> Path:
    """:func:`check_output_dir` for a run's ``output.dir`` (checkpoints, ``job.json``, metrics)."""
    return check_output_dir(path, key="output.dir", fix=RUN_DIR_FIX)


def claim_run_dir(path: str | Path) -> Path:
    """:func:`claim_output_dir` for a run's ``output.dir``: before the first file of a run is written."""
    return claim_output_dir(path, key="output.dir", fix=RUN_DIR_FIX)


@contextlib.contextmanager
def staged_output_dir(path: str | Path) -> Iterator[Path]:
    """:func:`claim_output_dir` for one write that may fail part way (a damaged checkpoint is
    found only as it is read): on an error, a directory this claim created is removed again,
    with the temporary files in it, so a refused export leaves nothing behind. A directory that
    existed keeps what it held."""
    created = not Path(path).exists()
    out = claim_output_dir(path)
    try:
        yield out
    except BaseException:
        if created:
            shutil.rmtree(out, ignore_errors=True)
        raise


def is_ours(path: str | Path) -> bool:
    """Whether ``path`` is a directory neuron-flows created (it holds the marker)."""
    return (Path(path) / OWNER_FILE).is_file()


def _staging(path: Path) -> tuple[Path, Path, Path]:
    """The staging folder of the output ``path``, the replacement in it (``path``'s own name) and
    where the earlier output waits while they are swapped."""
    root = path.with_name(path.name + STAGING_SUFFIX)
    return root, root / path.name, root / f"{path.name}.previous"


def staged_dir(path: str | Path) -> Path:
    """Where the replacement of the output ``path`` is written: ``<path>.staging/<name>`` (the
    same name, on the same file system, so the swap is a rename)."""
    return _staging(Path(path))[1]


def check_replaceable_dir(path: str | Path, *, key: str | None = None) -> Path:
    """:func:`check_output_dir` for ``path`` and for the folder its replacement is staged in."""
    out = check_output_dir(path, key=key)
    check_output_dir(_staging(out)[0], key=f"{key} (its staging folder)" if key else None)
    return out


def stage_output_dir(path: str | Path, *, key: str | None = None) -> Path:
    """Claim a folder beside ``path`` to write its replacement in, and return the directory to
    write (:func:`staged_dir`; claimed by the writer). ``path`` is checked but left as it is: an
    earlier output there stays until :func:`replace_with_staged`. What an earlier attempt left
    staged is dropped first (:func:`discard_staged`)."""
    out = check_replaceable_dir(path, key=key)
    discard_staged(out)
    root, staged, _ = _staging(out)
    claim_output_dir(root)
    return staged


def replace_with_staged(path: str | Path) -> Path:
    """Put the output staged for ``path`` in its place, replacing the earlier output there (one of
    ours, or an empty directory; anything else is refused), then remove the staging folder. A swap
    cut short is put right by the next :func:`stage_output_dir` or :func:`discard_staged`: the
    earlier output goes back, unless the new one was already in place."""
    out = check_output_dir(path)
    root, staged, previous = _staging(out)
    if not (is_ours(root) and is_ours(staged)):
        raise FileNotFoundError(f"no output is staged for {out} (no {staged} written by neuron-flows)")
    if out.is_dir() and any(out.iterdir()):
        out.rename(previous)
    os.replace(staged, out)  # over a missing or empty directory
    fsync_path(out.parent)
    shutil.rmtree(root)
    return out


def discard_staged(path: str | Path) -> None:
    """Drop what is staged for ``path`` (its staging folder, if neuron-flows created it) and put an
    earlier output back where a swap was cut short; ``path`` itself is never removed."""
    out = Path(path)
    root, _, previous = _staging(out)
    if not is_ours(root):
        return
    if previous.is_dir() and not out.exists():
        previous.rename(out)
    shutil.rmtree(root)
    fsync_path(out.parent)
