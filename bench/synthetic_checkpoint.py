"""The synthetic checkpoint ``consolidate.py`` measures: a Llama-shaped model (GQA) at tp=4 x pp=2
in our format (``neuron_parallel.checkpoint.format``), written file by file so that the whole
model is never in memory, sharded as tensor parallelism shards it (q/k/v/gate/up along dim 0,
o/down along dim 1, embed_tokens/lm_head along the vocab, norms stored once by tp rank 0), with
config.json, manifest.json (sizes, sha256, pieces) and COMPLETE; and the same tensors as a DCP
checkpoint. Every piece is rebuilt from its seed (``make_piece``), so outputs can be checked
without reading the inputs back."""

from __future__ import annotations

import hashlib
import json
import zlib
from pathlib import Path

TP, PP = 4, 2
STEP = 100
# Llama-shaped, GQA: 12 heads of 128, 4 KV heads (one per tp rank). Layers are chosen for the size.
HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 1536, 4096, 12, 4, 128, 32000
ROW_SPLIT = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
COL_SPLIT = ("o_proj", "down_proj")


def itemsize(dtype: str) -> int:
    return {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]


def _layer_shapes(i: int) -> dict[str, list[int]]:
    p = f"model.layers.{i}."
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    return {
        p + "input_layernorm.weight": [HIDDEN],
        p + "self_attn.q_proj.weight": [q, HIDDEN],
        p + "self_attn.k_proj.weight": [kv, HIDDEN],
        p + "self_attn.v_proj.weight": [kv, HIDDEN],
        p + "self_attn.o_proj.weight": [HIDDEN, q],
        p + "post_attention_layernorm.weight": [HIDDEN],
        p + "mlp.gate_proj.weight": [INTERMEDIATE, HIDDEN],
        p + "mlp.up_proj.weight": [INTERMEDIATE, HIDDEN],
        p + "mlp.down_proj.weight": [HIDDEN, INTERMEDIATE],
    }


def numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def choose_layers(size_bytes: float, dtype: str) -> int:
    per_layer = sum(numel(s) for s in _layer_shapes(0).values()) * itemsize(dtype)
    fixed = (2 * VOCAB * HIDDEN + HIDDEN) * itemsize(dtype)  # embed, lm_head (untied), final norm
    layers = round(max(size_bytes - fixed, 0) / per_layer / PP) * PP
    return max(layers, PP)


def stage_shapes(layers: int) -> list[dict[str, list[int]]]:
    """Global shapes of the tensors each pipeline stage holds (embed first, norm + lm_head last)."""
    per = layers // PP
    stages = []
    for pp in range(PP):
        shapes: dict[str, list[int]] = {}
        if pp == 0:
            shapes["model.embed_tokens.weight"] = [VOCAB, HIDDEN]
        for i in range(pp * per, (pp + 1) * per):
            shapes.update(_layer_shapes(i))
        if pp == PP - 1:
            shapes["model.norm.weight"] = [HIDDEN]
            shapes["lm_head.weight"] = [VOCAB, HIDDEN]
        stages.append(shapes)
    return stages


def split_dim(name: str) -> int | None:
    """The dim tensor parallelism shards ``name`` along; None when it is replicated."""
    if any(k in name for k in ROW_SPLIT) or name in ("model.embed_tokens.weight", "lm_head.weight"):
        return 0
    if any(k in name for k in COL_SPLIT):
        return 1
    return None


def piece_box(name: str, shape: list[int], tp: int) -> tuple[list[int], list[int]] | None:
    """(offsets, shape) that tp rank ``tp`` stores of ``name``; None when it stores nothing."""
    d = split_dim(name)
    if d is None:
        return ([0] * len(shape), list(shape)) if tp == 0 else None
    if shape[d] % TP:
        raise ValueError(f"{name} dim {d} ({shape[d]}) does not divide by tp={TP}")
    n = shape[d] // TP
    offsets = [0] * len(shape)
    offsets[d] = tp * n
    local = list(shape)
    local[d] = n
    return offsets, local


def make_piece(name: str, tp: int, shape: list[int], dtype):
    """Deterministic contents of the piece ``tp`` stores of ``name`` (rebuildable for checks)."""
    import torch

    g = torch.Generator().manual_seed(zlib.crc32(name.encode()) * 16 + tp)
    return torch.randn(shape, generator=g, dtype=torch.float32).to(dtype)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def build_checkpoint(run_dir: Path, size_bytes: float, dtype_name: str) -> dict:
    """Write checkpoint-<STEP>/ in our format, one (tp, pp) file at a time. Returns facts about it."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    from neuron_parallel.checkpoint.format import COMPLETE, MANIFEST, Manifest, Piece, TensorEntry, model_file
    from neuron_parallel.config import ParallelConfig

    dtype = getattr(torch, dtype_name)
    layers = choose_layers(size_bytes, dtype_name)
    stages = stage_shapes(layers)
    ckpt = run_dir / f"checkpoint-{STEP}"
    ckpt.mkdir(parents=True)

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=layers,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        dtype=dtype_name,
    )
    config.save_pretrained(ckpt)
    files: dict[str, dict] = {}
    tensors: dict[str, TensorEntry] = {}
    for pp, shapes in enumerate(stages):
        for tp in range(TP):
            rel = model_file(tp, pp)
            local = {}
            for name, shape in shapes.items():
                box = piece_box(name, shape, tp)
                if box is None:
                    continue
                offsets, pshape = box
                local[name] = make_piece(name, tp, pshape, dtype)
                entry = tensors.setdefault(name, TensorEntry(shape=list(shape), dtype=dtype_name, kind="model"))
                entry.pieces.append(Piece(rel, name, offsets, pshape))
            path = ckpt / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            save_file(local, str(path), metadata={"format": "pt"})
            del local
            files[rel] = {"size": path.stat().st_size, "sha256": _sha256(path)}
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": STEP, "synthetic": True}))
    for name in ("config.json", "trainer_state.json"):
        files[name] = {"size": (ckpt / name).stat().st_size, "sha256": _sha256(ckpt / name)}
    manifest = Manifest(
        step=STEP,
        parallel={**_asdict(ParallelConfig(tp=TP, pp=PP)), "dp": 1},
        model_config=json.loads((ckpt / "config.json").read_text()),
        files=dict(sorted(files.items())),
        tensors=dict(sorted(tensors.items())),
    )
    (ckpt / MANIFEST).write_text(manifest.to_json())
    (ckpt / COMPLETE).write_text(json.dumps({"step": STEP}))

    item = itemsize(dtype_name)
    largest = max(tensors.items(), key=lambda kv: numel(kv[1].shape))
    shard_files = [r for r in files if r.startswith("shards/")]
    return {
        "checkpoint": str(ckpt),
        "layers": layers,
        "dtype": dtype_name,
        "num_tensors": len(tensors),
        "num_shard_files": len(shard_files),
        "tensor_bytes": sum(numel(t.shape) for t in tensors.values()) * item,
        "shard_file_bytes": sum(files[r]["size"] for r in shard_files),
        "largest_tensor": largest[0],
        "largest_tensor_bytes": numel(largest[1].shape) * item,
        "largest_piece_bytes": max(numel(p.shape) for t in tensors.values() for p in t.pieces) * item,
        "config": {
            "hidden_size": HIDDEN,
            "intermediate_size": INTERMEDIATE,
            "num_hidden_layers": layers,
            "num_attention_heads": HEADS,
            "num_key_value_heads": KV_HEADS,
            "vocab_size": VOCAB,
            "tie_word_embeddings": False,
        },
    }


def _asdict(obj) -> dict:
    from dataclasses import asdict

    return asdict(obj)


def build_dcp(ckpt: Path, dcp_dir: Path) -> None:
    """An equivalent DCP checkpoint: the same full tensors, one ``dcp.save`` without a process group.
    (Needs the full state in memory once; construction is not timed.)"""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    from neuron_parallel.checkpoint import CheckpointTensors

    ct = CheckpointTensors(ckpt)
    state = {name: ct.read(name) for name in ct.names("model")}
    dcp.save(
        state, storage_writer=FileSystemWriter(str(dcp_dir), single_file_per_rank=True, thread_count=1), no_dist=True
    )
