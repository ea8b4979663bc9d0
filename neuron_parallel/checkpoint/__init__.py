"""Sharded checkpoints: atomic save, resume on any topology, validation, consolidation, LoRA
adapter export and merge."""

from .adapter import export_adapter, merge_adapter
from .consolidate import consolidate_checkpoint
from .format import Manifest, is_complete, list_checkpoints, resolve_checkpoint
from .save import CheckpointWriter
from .tensors import CheckpointTensors, HFWeights, local_view
from .validate import validate_checkpoint

__all__ = [
    "CheckpointWriter",
    "CheckpointTensors",
    "HFWeights",
    "Manifest",
    "consolidate_checkpoint",
    "export_adapter",
    "is_complete",
    "list_checkpoints",
    "local_view",
    "merge_adapter",
    "resolve_checkpoint",
    "validate_checkpoint",
]
