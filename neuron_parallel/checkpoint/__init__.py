"""Sharded checkpoints: atomic save, resume on any topology, validation, and export to a Hugging
Face model directory (a full fine-tuning checkpoint, ours or optimum-neuron's; a LoRA checkpoint's
peft adapter, or its base model with the adapters merged in).

The names below are imported on first use (PEP 562), so that a caller that needs only the
format (``is_complete``, ``list_checkpoints``: the flow's failure report) does not import torch,
DTensor and the optimizer code behind saving and export.
"""

from __future__ import annotations

import importlib

_WHERE = {
    "CheckpointWriter": "save",
    "CheckpointTensors": "tensors",
    "HFWeights": "tensors",
    "Manifest": "format",
    "export_checkpoint": "export",
    "is_complete": "format",
    "list_checkpoints": "format",
    "resolve_checkpoint": "format",
    "validate_checkpoint": "validate",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
