"""Checkpoint validation: every problem found, one line each, naming the file and the fault."""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import safe_open

from ..utils import sha256_file
from .dtypes import dtype_name
from .format import COMPLETE, MANIFEST, Manifest, confined, resolve_checkpoint
from .shapes import expected_adapter_shapes, expected_shapes


def validate_checkpoint(path: str | Path, *, quick: bool = False, check_model: bool = True) -> list[str]:
    """Problems with the checkpoint at ``path`` (a run dir, checkpoint dir or its shards/);
    an empty list means valid.

    Always: COMPLETE and manifest present, every file named exists with the right size, every
    tensor's pieces lie inside its global shape and cover it exactly once. Unless ``quick``:
    sha256 of every file, each piece's stored shape and dtype, and no NaN/Inf in any tensor.
    With ``check_model``, every tensor's global shape against the model its config describes (for
    a LoRA checkpoint: the adapters of its targeted layers and its ``modules_to_save``).
    """
    try:
        ckpt = resolve_checkpoint(path)
    except ValueError as e:
        return [str(e)]
    problems: list[str] = []
    if not (ckpt / COMPLETE).is_file():
        problems.append(f"{ckpt / COMPLETE}: missing (the save did not finish)")
    try:
        manifest = Manifest.load(ckpt)
    except FileNotFoundError:
        return problems + [f"{ckpt / MANIFEST}: missing"]
    except (ValueError, KeyError, json.JSONDecodeError) as e:
        return problems + [f"{ckpt / MANIFEST}: unreadable ({e})"]

    bad_files: set[str] = set()
    for rel, info in manifest.files.items():
        f = ckpt / rel
        if not f.is_file():
            problems.append(f"{f}: missing")
            bad_files.add(rel)
            continue
        size = f.stat().st_size
        if size != info["size"]:
            problems.append(f"{f}: size {size} bytes, manifest says {info['size']} (truncated or overwritten)")
            bad_files.add(rel)
        elif not quick and sha256_file(f) != info["sha256"]:
            problems.append(f"{f}: sha256 mismatch (content changed since it was written)")
            bad_files.add(rel)

    for name, entry in manifest.tensors.items():
        total = 0
        for p in entry.pieces:
            if p.file not in manifest.files:
                problems.append(f"{ckpt / p.file}: holds {name} but is not listed in the manifest's files")
            if len(p.offsets) != len(entry.shape) or any(
                o < 0 or o + n > g for o, n, g in zip(p.offsets, p.shape, entry.shape)
            ):
                problems.append(f"{ckpt / p.file}: {name} slice {p.offsets}+{p.shape} lies outside {entry.shape}")
            total += math.prod(p.shape)
        if total != math.prod(entry.shape) or not _covers_exactly_once(entry.pieces, entry.shape):
            problems.append(
                f"{name}: pieces cover {total} elements of {math.prod(entry.shape)} "
                f"(global shape {entry.shape}); every element must be covered exactly once"
            )
    if check_model:
        problems += _check_against_model(ckpt, manifest)
    if quick:
        return problems
    problems += _check_contents(ckpt, manifest, bad_files)
    return problems


def verify_checksums(ckpt: Path, manifest: Manifest, files: Iterable[str] | None = None) -> None:
    """Hash every file the manifest lists (or those of ``files``, names it lists) and refuse, with
    a ``ValueError`` naming the file, the recorded and the actual digest, a file whose content
    changed since the save wrote it."""
    for rel in manifest.files if files is None else files:
        path = confined(ckpt, rel, f"{ckpt / MANIFEST}: files entry")
        check_digest(ckpt, path, sha256_file(path), manifest.files[rel]["sha256"])


def check_digest(ckpt: Path, path: Path, actual: str, recorded: str) -> None:
    """Refuse the file ``path`` of checkpoint ``ckpt`` when its sha256 ``actual`` is not the
    ``recorded`` one."""
    if actual != recorded:
        raise ValueError(
            f"{path}: sha256 {actual}, the manifest records {recorded}: the file changed after the "
            f"checkpoint was written (disk or copy damage); use an earlier checkpoint, and run "
            f"neuron-flows validate {ckpt} to list every damaged file"
        )


def _check_against_model(ckpt: Path, manifest: Manifest) -> list[str]:
    """Every parameter of the model in the manifest's config is present with its shape (a vocab
    dimension may be padded), and optimizer state matches its parameter's shape. A LoRA
    checkpoint holds its adapters and ``modules_to_save`` instead, and nothing else."""
    lora = (manifest.adapter or {}).get("lora")
    try:
        if lora is None:
            want = expected_shapes(manifest.model_config)
        else:
            want = expected_adapter_shapes(manifest.model_config, lora)
    except Exception as e:  # an unknown architecture is a finding about this checkpoint
        return [f"{ckpt / MANIFEST}: model_config does not describe a known model ({e})"]
    what = "parameter" if lora is None else "trainable tensor"
    problems = []
    have = {n: t for n, t in manifest.tensors.items() if t.kind == "model"}
    vocab = manifest.model_config.get("vocab_size")
    for name, shape in want.items():
        entry = have.get(name)
        if entry is None:
            problems.append(f"{ckpt}: {what} {name} {shape} is missing from the checkpoint")
        elif entry.shape != shape and not (
            entry.shape[1:] == shape[1:] and shape[0] == vocab and entry.shape[0] > vocab
        ):
            problems.append(f"{ckpt}: {name} has global shape {entry.shape}, the model expects {shape}")
    for name in sorted(set(have) - set(want)):
        if lora is None:
            problems.append(f"{ckpt}: {name} is not a parameter of this model")
        else:
            problems.append(
                f"{ckpt}: {name} is not a trainable tensor of this LoRA checkpoint (adapters of "
                f"{lora['target_modules']} and modules_to_save {lora.get('modules_to_save', [])})"
            )
    for name, entry in manifest.tensors.items():
        if entry.kind == "optim":
            param = name.rsplit(".", 1)[0]
            if param in have and entry.shape != have[param].shape:
                problems.append(
                    f"{ckpt}: optimizer state {name} has shape {entry.shape}, its parameter {have[param].shape}"
                )
    return problems


MAX_SPLIT_DIMS = 8
"""The most dimensions a tensor's pieces may split it along (this tool and neuronx-distributed
split one or two); pieces that split more are not a layout any writer makes, and are reported
as not covering the tensor."""


def _covers_exactly_once(pieces, shape: list[int]) -> bool:
    """Whether ``pieces`` (rectangular slices) cover every element of a tensor of ``shape`` exactly
    once: none overlaps another, and none reaches outside ``shape`` (pieces whose sizes add up to
    the tensor's then leave no element uncovered).

    Linear in the number of pieces, not quadratic in pairs: a box's indicator function is the
    signed sum of the orthant indicators at its 2^d corners (+ at ``offsets``, − where one
    coordinate is at the box's end, and so on), a function has one such sum, so the pieces' sum
    equals the tensor's one box exactly when the corner weights of all pieces, less the tensor's,
    cancel at every point. Dimensions no piece splits are left out first."""
    ndim = len(shape)
    if any(len(p.offsets) != ndim or len(p.shape) != ndim or any(n < 0 for n in p.shape) for p in pieces):
        return False
    if math.prod(shape) == 0:  # no element to cover; the caller has seen the pieces hold none either
        return True
    split = [k for k in range(ndim) if any(p.offsets[k] != 0 or p.shape[k] != shape[k] for p in pieces)]
    if not split:  # every piece is the whole tensor
        return len(pieces) == 1
    if len(split) > MAX_SPLIT_DIMS:
        return False
    starts = [[p.offsets[k] for p in pieces] for k in split]
    ends = [[p.offsets[k] + p.shape[k] for p in pieces] for k in split]
    plus, minus = Counter(), Counter()  # corners of weight +1 and -1, the tensor's own with the opposite sign
    for mask in range(1 << len(split)):  # which coordinates are taken at the end
        even = bin(mask).count("1") % 2 == 0
        (plus if even else minus).update(zip(*(ends[i] if mask >> i & 1 else starts[i] for i in range(len(split)))))
        (minus if even else plus)[tuple(shape[k] if mask >> i & 1 else 0 for i, k in enumerate(split))] += 1
    return plus == minus


def _check_contents(ckpt: Path, manifest: Manifest, bad_files: set[str]) -> list[str]:
    problems = []
    by_file: dict[str, list] = {}
    for name, entry in manifest.tensors.items():
        for p in entry.pieces:
            by_file.setdefault(p.file, []).append((name, entry, p))
    for rel, items in sorted(by_file.items()):
        if rel in bad_files or not (ckpt / rel).is_file():
            continue
        try:
            with safe_open(str(ckpt / rel), framework="pt") as f:
                keys = set(f.keys())
                for _name, entry, p in items:
                    if p.key not in keys:
                        problems.append(f"{ckpt / rel}: tensor {p.key} missing")
                        continue
                    t = f.get_tensor(p.key)
                    if list(t.shape) != p.shape or dtype_name(t.dtype) != entry.dtype:
                        problems.append(
                            f"{ckpt / rel}: {p.key} is {list(t.shape)} {t.dtype}, manifest says {p.shape} {entry.dtype}"
                        )
                    elif t.is_floating_point() and not torch.isfinite(t).all():
                        problems.append(f"{ckpt / rel}: {p.key} contains NaN or Inf")
        except Exception as e:  # a corrupt header is a finding, not a crash
            problems.append(f"{ckpt / rel}: unreadable safetensors ({e})")
    return problems
