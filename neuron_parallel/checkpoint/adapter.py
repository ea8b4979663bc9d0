"""LoRA checkpoints as tensor sources for ``hf_dir.py``: the peft adapter, or the base model with
the adapters merged in.

A LoRA checkpoint (``Manifest.adapter`` set) holds only what was trained: ``<layer>.lora_A``
(r × in) and ``<layer>.lora_B`` (out × r) of every targeted projection, and the ``modules_to_save``
weights (a tied lm_head under ``model.embed_tokens.weight``). Two ways out:

* :class:`AdapterSource`: peft's format, so ``PeftModel.from_pretrained(base, dir)`` loads it.
  ``adapter_config.json`` carries peft's ``LoraConfig`` fields (:func:`peft_config`);
  ``adapter_model.safetensors`` keys are the module paths under ``base_model.model.`` with peft's
  ``.weight`` suffix (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``), and a
  module to save is keyed by its plain weight name (``base_model.model.lm_head.weight``), which is
  how peft's ``get_peft_model_state_dict`` writes them. On a tied model the trained embedding is
  the head too: peft ties the two with ``ensure_weight_tying`` and saves the weight under both
  names.
* :class:`MergedSource`: a full Hugging Face model, every tensor streamed from the base model's
  safetensors (refused unless its digest is the one the manifest recorded: :func:`base_model_dir`),
  ``W + (alpha / r) B A`` computed in fp32 and cast back to the base dtype for targeted weights,
  ``modules_to_save`` replaced by the trained ones.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .dtypes import dtype_from_name
from .format import (
    TOKENIZER_FILES,
    Manifest,
    base_model_identity,
    check_base_model,
    model_files,
    resolve_checkpoint,
)
from .shapes import MODULE_WEIGHTS, lora_targets, saved_module_names
from .tensors import CheckpointTensors, HFWeights
from .validate import validate_checkpoint, verify_checksums

__all__ = [
    "AdapterSource",
    "MergedSource",
    "base_model_dir",
    "open_adapter_checkpoint",
    "peft_config",
    "peft_name",
]

PEFT_PREFIX = "base_model.model."


def open_adapter_checkpoint(path: str | Path) -> CheckpointTensors:
    """The LoRA checkpoint at ``path`` (run dir, checkpoint dir or ``shards/``), after quick
    validation and its files' sha256. Refuses a full fine-tuning checkpoint and an incomplete or
    damaged one."""
    ckpt = resolve_checkpoint(path)
    problems = validate_checkpoint(ckpt, quick=True, check_model=False)
    if problems:
        raise ValueError(f"refusing to export {ckpt}: " + "; ".join(problems))
    tensors = CheckpointTensors(ckpt)
    if tensors.manifest.adapter is None:
        raise ValueError(
            f"{ckpt} is a full fine-tuning checkpoint, not a LoRA one: it has no adapters to export or "
            "merge; consolidate it without --merge"
        )
    verify_checksums(ckpt, tensors.manifest)
    tensors.check_pieces()
    return tensors


def peft_name(name: str) -> str:
    """A checkpoint tensor name → its key in peft's ``adapter_model.safetensors``."""
    for suffix in (".lora_A", ".lora_B"):
        if name.endswith(suffix):
            return f"{PEFT_PREFIX}{name}.weight"
    return PEFT_PREFIX + name


def peft_config(
    manifest: Manifest, base_model_name: str | None = None, base_model_revision: str | None = None
) -> dict[str, Any]:
    """``adapter_config.json`` for the checkpoint's adapters: peft's ``LoraConfig`` fields that
    describe what the engine trained (``W x + (alpha / r) B A dropout(x)``, no bias, no rsLoRA or
    DoRA). ``base_model_name`` (and its Hub ``base_model_revision``) default to the base model
    directory the manifest records."""
    lora, base = manifest.adapter["lora"], manifest.adapter["base_model"]
    tied = bool(manifest.model_config.get("tie_word_embeddings"))
    alpha = lora["alpha"]
    modules = sorted(lora.get("modules_to_save", []))
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name or base["name_or_path"],
        "revision": base_model_revision,
        "r": lora["r"],
        "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha,
        "lora_dropout": lora["dropout"],
        "target_modules": sorted(lora["target_modules"]),
        # On a tied model peft keeps the embedding and the head one module (ensure_weight_tying).
        "modules_to_save": (["embed_tokens"] if tied else modules) or None,
        "ensure_weight_tying": tied and bool(modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "lora_bias": False,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "inference_mode": True,
    }


class AdapterSource:
    """The adapters and modules to save of a LoRA checkpoint under peft's names, for the writer,
    with the tokenizer files of the checkpoint (or of ``model_dir``, the user's model directory)."""

    def __init__(self, tensors: CheckpointTensors, model_dir: str | Path | None = None) -> None:
        self.tensors = tensors
        self._model_dir = model_dir
        self.model_config = tensors.manifest.model_config
        vocab = self.model_config.get("vocab_size")
        tied = bool(self.model_config.get("tie_word_embeddings"))
        self._names: dict[str, tuple[str, list[int]]] = {}
        for name in tensors.names("model"):
            shape = list(tensors.manifest.tensors[name].shape)
            if name in MODULE_WEIGHTS.values() and vocab and shape[0] > vocab:
                shape[0] = vocab  # rows a vocab-parallel layout padded on
            self._names[peft_name(name)] = (name, shape)
            if tied and name == MODULE_WEIGHTS["embed_tokens"]:
                self._names[peft_name(MODULE_WEIGHTS["lm_head"])] = (name, shape)
        self._plan = [
            (key, shape, dtype_from_name(tensors.manifest.tensors[name].dtype))
            for key, (name, shape) in sorted(self._names.items())
        ]

    def plan(self) -> list[tuple[str, list[int], torch.dtype]]:
        return self._plan

    def read(self, key: str) -> torch.Tensor:
        name, shape = self._names[key]
        return self.tensors.read(name, [0] * len(shape), shape)

    def hf_files(self) -> list[Path]:
        return model_files(self.tensors.root, self._model_dir, TOKENIZER_FILES)


class MergedSource:
    """The base model with a checkpoint's adapters merged in, as a ``TensorSource``: the base's
    tensors in its order, names, shapes and dtypes, read row block by row block."""

    def __init__(self, tensors: CheckpointTensors, base_dir: Path, model_dir: str | Path | None = None) -> None:
        self.tensors = tensors
        self.base = HFWeights(base_dir)
        self.model_config = tensors.manifest.model_config
        lora = tensors.manifest.adapter["lora"]
        self.scale = lora["alpha"] / lora["r"]
        self._plan = [(name, *self.base.shape_dtype(name)) for name in self.base.names()]
        names = [name for name, _, _ in self._plan]
        self._adapted = {name: name.removesuffix(".weight") for name in lora_targets(names, lora["target_modules"])}
        # A tied head is the embedding: both take the trained embedding.
        tied = bool(self.model_config.get("tie_word_embeddings"))
        saved = saved_module_names(self.model_config, lora.get("modules_to_save", []))
        self._replaced = {}
        for name in MODULE_WEIGHTS.values():
            stored = MODULE_WEIGHTS["embed_tokens"] if tied else name
            if stored in saved and name in names:
                self._replaced[name] = stored
        needed = [f"{p}.lora_{ab}" for p in self._adapted.values() for ab in "AB"] + list(self._replaced.values())
        missing = [name for name in needed if name not in tensors]
        if missing:
            raise ValueError(
                f"{tensors.root} lacks {len(missing)} tensors the base model in {base_dir} needs ({missing[:3]}…); "
                f"run neuron-flows validate {tensors.root}"
            )
        self._check_shapes(lora["r"], base_dir)
        self._model_dir = model_dir
        self._a_cache: tuple[str, torch.Tensor] | None = None

    def plan(self) -> list[tuple[str, list[int], torch.dtype]]:
        return self._plan

    def _check_shapes(self, r: int, base_dir: Path) -> None:
        """Every adapter fits the base weight it merges into (A: r × in, B: out × r) and every
        replaced module has the base weight's shape (its vocab rows possibly padded)."""
        stored = {name: self.tensors.manifest.tensors[name].shape for name in self.tensors.names("model")}
        for name, shape, _ in self._plan:
            if name in self._adapted and len(shape) == 2:
                prefix, (out_dim, in_dim) = self._adapted[name], shape
                want = {f"{prefix}.lora_A": [r, in_dim], f"{prefix}.lora_B": [out_dim, r]}
            elif name in self._replaced:
                have = stored[self._replaced[name]]
                want = {self._replaced[name]: [max(shape[0], have[0]), *shape[1:]] if shape else shape}
            else:
                continue
            for key, expected in want.items():
                if list(stored[key]) != list(expected):
                    raise ValueError(
                        f"{self.tensors.root}: {key} has shape {stored[key]}, but the base weight {name} in "
                        f"{base_dir} is {shape}, which needs {expected}; the adapters belong to another base model"
                    )

    def _lora_a(self, prefix: str) -> torch.Tensor:
        if self._a_cache is None or self._a_cache[0] != prefix:
            self._a_cache = (prefix, self.tensors.read(f"{prefix}.lora_A").float())
        return self._a_cache[1]

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` of the merged tensor ``name``."""
        shape, dtype = self.base.shape_dtype(name)
        box = [start] + [0] * (len(shape) - 1), [stop - start, *shape[1:]]
        if name in self._replaced:
            return self.tensors.read(self._replaced[name], *box).to(dtype)
        weight = self.base.read(name, *box)
        if name not in self._adapted:
            return weight
        prefix = self._adapted[name]
        a = self._lora_a(prefix)
        b = self.tensors.read(f"{prefix}.lora_B", [start, 0], [stop - start, a.shape[0]])
        return (weight.float() + self.scale * (b.float() @ a)).to(dtype)

    def read(self, name: str) -> torch.Tensor:
        shape, _ = self.base.shape_dtype(name)
        if not shape:
            return self.base.read(name)
        return self.read_rows(name, 0, shape[0])

    def byte_ranges(self, name: str) -> list[tuple[Path, int, int]] | None:
        """The base file's bytes of a tensor the adapters leave as it is (copied in the kernel)."""
        if name in self._adapted or name in self._replaced:
            return None
        return [self.base.byte_range(name)]

    def hf_files(self) -> list[Path]:
        return model_files(self.tensors.root, self._model_dir)


def base_model_dir(tensors: CheckpointTensors, base_dir: str | Path | None) -> Path:
    """The base model directory to merge into: ``base_dir``, or the one the manifest records.
    Refuses one that is missing or whose weights are not the ones the adapters were trained on
    (:func:`~.format.check_base_model`)."""
    recorded = tensors.manifest.adapter["base_model"]
    base = Path(base_dir if base_dir is not None else recorded["name_or_path"])
    if not base.is_dir() or not any(base.glob("*.safetensors")):
        raise ValueError(
            f"base model {base} is not a directory with safetensors weights; pass --base-dir (base_dir=) "
            f"pointing at the base model the adapters were trained on ({recorded['name_or_path']})"
        )
    check_base_model(tensors.manifest, base_model_identity(base))
    return base
