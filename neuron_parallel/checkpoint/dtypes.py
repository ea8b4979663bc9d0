"""The tensor dtypes checkpoints hold, and their names in manifests and safetensors headers."""

from __future__ import annotations

import torch

__all__ = ["DTYPES", "dtype_from_name", "dtype_from_safetensors", "dtype_name", "safetensors_dtype"]

DTYPES: tuple[tuple[torch.dtype, str], ...] = (
    (torch.float32, "F32"),
    (torch.bfloat16, "BF16"),
    (torch.float16, "F16"),
    (torch.int64, "I64"),
    (torch.int32, "I32"),
)
"""The tensor dtypes checkpoints hold, each with its safetensors header code. Our manifests
name a dtype as torch prints it without the ``torch.`` prefix (``float32``)."""


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` → ``"float32"``, the name manifests record."""
    return str(dtype).removeprefix("torch.")


_BY_NAME = {dtype_name(d): d for d, _ in DTYPES}
_BY_CODE = {code: d for d, code in DTYPES}
_CODES = {d: code for d, code in DTYPES}


def dtype_from_name(name: str) -> torch.dtype:
    """A manifest dtype name (``"float32"`` or ``"torch.float32"``) → ``torch.float32``."""
    return _BY_NAME[name.removeprefix("torch.")]


def dtype_from_safetensors(code: str) -> torch.dtype:
    """A safetensors header dtype (``"F32"``) → ``torch.float32``."""
    return _BY_CODE[code]


def safetensors_dtype(dtype: torch.dtype) -> str:
    """``torch.float32`` → ``"F32"``, the safetensors header dtype."""
    return _CODES[dtype]
