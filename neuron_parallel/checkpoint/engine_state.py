"""Translation between a training :class:`~neuron_parallel.engine.Engine` and checkpoint tensors.

A checkpoint stores every tensor under its Hugging Face name, as global tensors sliced by
whichever rank held each piece; optimizer state as ``<param name>.<state key>``. Two rules live
here and nowhere else:

* a tied lm_head is the embedding: stored once, under ``model.embed_tokens.weight`` (with its
  optimizer state), even when pipeline stages hold two copies of it;
* optimizer state is stored by every dp rank for its own partition under ZeRO-1, by dp rank 0
  alone otherwise.

Loading reads, on every rank, exactly the slices it now holds, whatever layout wrote them.
"""

from __future__ import annotations

import dataclasses

import torch

from ..models.causal_lm import load_weights
from ..optim import STATE_KEYS
from ..parallel.dtensor import local_view
from ..parallel.zero import Zero1Optimizer

_HEAD, _EMBED = "lm_head.weight", "model.embed_tokens.weight"


def _stored(engine, name: str) -> bool:
    """Whether ``name`` (a parameter or ``<parameter>.<state key>``) is stored under its own name."""
    return not (engine.tied and name.startswith(_HEAD))


def _source_name(engine, name: str) -> str:
    """The checkpoint name ``name`` is read from: a tied lm_head reads the embedding's."""
    return name if _stored(engine, name) else _EMBED + name[len(_HEAD) :]


def model_tensors(engine) -> dict[str, torch.Tensor]:
    """The parameters this rank holds, by checkpoint name (DTensors keep their global slice)."""
    return {name: p.detach() for name, p in engine.named_parameters() if _stored(engine, name)}


def optim_tensors(engine, dp_rank: int) -> dict[str, torch.Tensor]:
    """Optimizer state this dp rank stores: ``<param name>.<state key>``: its own partition
    under ZeRO-1, everything on dp rank 0 otherwise."""
    optimizer = engine.optimizer
    if isinstance(optimizer, Zero1Optimizer):
        state = optimizer.state_tensors()
    elif dp_rank != 0:
        state = {}
    else:
        names = {id(p): n for n, p in engine.named_parameters()}
        state = {
            f"{names[id(p)]}.{key}": value
            for p, st in optimizer.state.items()
            for key, value in st.items()
            if key in STATE_KEYS
        }
    return {k: v for k, v in state.items() if _stored(engine, k)}


def adapter_meta(engine, base: dict) -> dict | None:
    """The manifest's ``adapter`` entry of a LoRA engine (None for full fine-tuning)."""
    if engine.lora is None:
        return None
    return {"lora": dataclasses.asdict(engine.lora), "base_model": base}


def load_engine_state(engine, tensors, step: int) -> None:
    """Restore ``engine``'s parameters and optimizer state from ``CheckpointTensors`` written
    at optimizer step ``step``. Under LoRA only the trainable tensors come from the checkpoint;
    the frozen base stays as loaded from the base model."""
    trainable = {name for name, _ in engine.named_parameters()}
    for name, p in engine.named_parameters():  # a slice of a tensor of another shape is refused
        if _source_name(engine, name) in tensors:
            tensors.check_shape(_source_name(engine, name), local_view(p)[1])
    for part in engine.parts:
        load_weights(part, tensors, tied=engine.tied, skip=lambda name: name not in trainable)

    def read(key: str, like: torch.Tensor) -> torch.Tensor | None:
        key = _source_name(engine, key)
        if key not in tensors:
            return None
        local, _, offsets = local_view(torch.zeros_like(like))
        return tensors.read(key, offsets, list(local.shape)).to(local.device)

    optimizer = engine.optimizer
    inner = optimizer.inner.optim if isinstance(optimizer, Zero1Optimizer) else optimizer
    fused = bool(inner.defaults.get("fused"))

    def state_of(name: str, p: torch.Tensor, *, local_shards: bool) -> dict:
        state = {}
        for key in STATE_KEYS:
            value = read(f"{name}.{key}", p)
            if value is None:
                continue
            if not local_shards:  # a tensor laid out like the parameter (a DTensor under TP)
                holder = torch.zeros_like(p)
                local_view(holder)[0].copy_(value)
                value = holder
            state[key] = value
        if "exp_avg" in state:  # where torch's load_state_dict puts it: the fused kernel reads it on the device
            state["step"] = torch.tensor(float(step), device=p.device if fused else "cpu")
        return state

    if isinstance(optimizer, Zero1Optimizer):
        optimizer.load_state(lambda name, p: state_of(name, p, local_shards=True))
        return
    for name, p in engine.named_parameters():
        state = state_of(name, p, local_shards=False)
        if state:
            optimizer.state[p] = state
