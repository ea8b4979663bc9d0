"""Output directories the tool writes into, and may therefore clean or remove.

The tool never deletes what it did not create. Consolidation and export write only into a
directory that is new, empty, or one they wrote before (it holds :data:`OWNER_FILE`, created with
the directory's first file); anything else is refused before a byte is written. A rollback
removes a directory only when it carries that marker.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

OWNER_FILE = ".neuron-flows-output"
"""The marker of a directory written by neuron-flows (left out of Hub uploads)."""


def claim_output_dir(path: str | Path) -> Path:
    """``path`` ready to write into: created (with the marker) when missing or empty, accepted when
    it carries the marker; a directory with anything else in it, or a file, is refused."""
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise ValueError(f"the output {out} is a file; name a new or empty directory")
    if out.is_dir() and any(out.iterdir()) and not is_ours(out):
        raise ValueError(
            f"the output directory {out} already holds files that neuron-flows did not write; name a new or empty "
            "directory (nothing there was changed)"
        )
    out.mkdir(parents=True, exist_ok=True)
    marker = out / OWNER_FILE
    if not marker.exists():
        marker.write_text(json.dumps({"written_by": "neuron-flows"}) + "\n")
    return out


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
