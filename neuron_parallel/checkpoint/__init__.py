"""Sharded checkpoints: atomic save, resume on any topology, validation, consolidation, LoRA
adapter export and merge.

The names below are imported on first use (PEP 562), so that a caller that needs only the
format (``is_complete``, ``list_checkpoints``: the flow's failure report) does not import torch,
DTensor and the optimizer code behind saving and consolidation.
"""

from __future__ import annotations

import importlib

_WHERE = {
    "CheckpointWriter": "save",
    "CheckpointTensors": "tensors",
    "HFWeights": "tensors",
    "Manifest": "format",
    "consolidate_checkpoint": "consolidate",
    "export_adapter": "adapter",
    "is_complete": "format",
    "list_checkpoints": "format",
    "merge_adapter": "adapter",
    "resolve_checkpoint": "format",
    "validate_checkpoint": "validate",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
