"""Choosing the checkpoint a run continues from."""

from __future__ import annotations

from pathlib import Path

from .format import COMPLETE, list_checkpoints, resolve_checkpoint
from .validate import validate_checkpoint


def find_resume_checkpoint(run_dir: str | Path, resume_from: str | None = None) -> tuple[Path | None, list[str]]:
    """The newest valid, complete checkpoint in ``run_dir``, else in ``resume_from`` (another run
    dir or a checkpoint), else None; plus one warning per newer checkpoint skipped and why."""
    skipped: list[str] = []
    candidates = list(reversed(list_checkpoints(run_dir)))
    if not candidates and resume_from:
        src = Path(resume_from)
        candidates = (
            [src] if (src / COMPLETE).exists() else list(reversed(list_checkpoints(resolve_checkpoint(src).parent)))
        )
    for ckpt in candidates:
        problems = validate_checkpoint(ckpt)
        if not problems:
            return ckpt, skipped
        skipped.append(f"skipping {ckpt}: " + "; ".join(problems))
    return None, skipped
