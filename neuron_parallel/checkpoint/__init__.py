"""Sharded checkpoints: atomic save, resume on any topology, validation, consolidation."""

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
    "is_complete",
    "list_checkpoints",
    "local_view",
    "resolve_checkpoint",
    "validate_checkpoint",
]
