"""Consolidation's one pass over the piece files (``neuron_parallel/checkpoint/scatter.py``) writes
exactly what the tensor-by-tensor writer writes, for row-split, column-split, inner-dim-split,
vocab-padded, scalar and bf16 tensors, in one file or several, whatever the read block size; a
piece file whose bytes changed is refused after the pass without touching an earlier export, and
a manifest that gives one stored tensor to two tensors is refused before it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from neuron_parallel.checkpoint import export_checkpoint
from neuron_parallel.checkpoint import scatter as scatter_module
from neuron_parallel.checkpoint.consolidate import open_source
from neuron_parallel.checkpoint.format import COMPLETE, MANIFEST, Manifest, Piece, TensorEntry
from neuron_parallel.checkpoint.hf_dir import write_hf_dir
from neuron_parallel.checkpoint.tensors import HFWeights
from neuron_parallel.utils import sha256_file

VOCAB = 9  # the embedding and head are stored padded to 10 rows, as a vocab-parallel layer pads them
G = torch.Generator().manual_seed(0)
TENSORS = {  # name: (global tensor, split dim or None, dtype)
    "model.embed_tokens.weight": (torch.randn(10, 4, generator=G), 0),
    "model.layers.0.self_attn.o_proj.weight": (torch.randn(4, 6, generator=G), 1),
    "model.layers.0.mlp.down_proj.weight": (torch.randn(6, 8, generator=G).bfloat16(), 1),
    "model.layers.0.experts.weight": (torch.randn(2, 4, 6, generator=G), 2),
    "model.norm.weight": (torch.randn(4, generator=G), None),
    "model.scale": (torch.tensor(3.5), None),
    "lm_head.weight": (torch.randn(10, 4, generator=G), 0),
}
OPTIM = {"model.norm.weight.exp_avg": torch.randn(4, generator=G)}


def exported(name: str) -> torch.Tensor:
    t = TENSORS[name][0]
    return t[:VOCAB] if name in ("model.embed_tokens.weight", "lm_head.weight") else t


def make_checkpoint(run: Path) -> Path:
    """Our format at tp=2: each split tensor in two halves along its dim, the rest on rank 0,
    optimizer state in its own file."""
    ckpt = run / "checkpoint-1"
    files: dict[str, dict[str, torch.Tensor]] = {}
    entries = {}
    for name, (full, dim) in TENSORS.items():
        entry = TensorEntry(shape=list(full.shape), dtype=str(full.dtype).removeprefix("torch."), kind="model")
        parts = [full] if dim is None else list(full.chunk(2, dim))
        for tp, part in enumerate(parts):
            rel = f"shards/tp_rank_{tp:02d}_pp_rank_00/model.safetensors"
            files.setdefault(rel, {})[name] = part.contiguous()
            offsets = [0] * full.dim()
            if dim is not None:
                offsets[dim] = tp * parts[0].shape[dim]
            entry.pieces.append(Piece(rel, name, offsets, list(part.shape)))
        entries[name] = entry
    optim_rel = "shards/tp_rank_00_pp_rank_00/optim/dp_rank_00.safetensors"
    files[optim_rel] = dict(OPTIM)
    for name, t in OPTIM.items():
        entries[name] = TensorEntry(shape=list(t.shape), dtype="float32", kind="optim")
        entries[name].pieces.append(Piece(optim_rel, name, [0], list(t.shape)))
    for rel, tensors in files.items():
        (ckpt / rel).parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(ckpt / rel), metadata={"format": "pt"})
    config = {"model_type": "llama", "vocab_size": VOCAB, "tie_word_embeddings": False}
    (ckpt / "config.json").write_text(json.dumps(config))
    listed = {rel: {"size": (ckpt / rel).stat().st_size, "sha256": sha256_file(ckpt / rel)} for rel in files}
    listed["config.json"] = {"size": (ckpt / "config.json").stat().st_size, "sha256": sha256_file(ckpt / "config.json")}
    manifest = Manifest(step=1, parallel={"tp": 2}, model_config=config, files=listed, tensors=entries)
    (ckpt / MANIFEST).write_text(manifest.to_json())
    (ckpt / COMPLETE).write_text(json.dumps({"step": 1}))
    return ckpt


class Streamed:
    """Our source without its one-pass writer: the tensor-by-tensor path writes the output."""

    def __init__(self, source) -> None:
        self.source = source
        self.model_config = source.model_config

    def __getattr__(self, name):
        if name in ("scatter", "verify"):
            raise AttributeError(name)
        return getattr(self.source, name)


def weight_files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.name.startswith("model")}


@pytest.mark.parametrize("block", [64, 1 << 20])
@pytest.mark.parametrize("max_shard_size", ["5GB", "200B"])
def test_one_pass_writes_what_the_streaming_writer_writes(tmp_path, monkeypatch, block, max_shard_size):
    monkeypatch.setattr(scatter_module, "BLOCK_BYTES", block)  # 64: many chunks per piece, rows split
    ckpt = make_checkpoint(tmp_path / "run")
    one_pass = export_checkpoint(ckpt, tmp_path / "one_pass", max_shard_size=max_shard_size)
    streamed = write_hf_dir(Streamed(open_source(ckpt)), tmp_path / "streamed", max_shard_size=max_shard_size)
    files = weight_files(one_pass)
    assert files == weight_files(streamed) and len(files) == (1 if max_shard_size == "5GB" else 6)
    weights = HFWeights(one_pass)
    assert sorted(weights.names()) == sorted(TENSORS)
    for name in TENSORS:
        assert torch.equal(weights.read(name), exported(name)), name
    assert not list(one_pass.glob("*.tmp"))


def test_the_optimizer_state_is_neither_read_nor_hashed(tmp_path, monkeypatch):
    ckpt = make_checkpoint(tmp_path / "run")
    optim = ckpt / "shards/tp_rank_00_pp_rank_00/optim/dp_rank_00.safetensors"
    data = bytearray(optim.read_bytes())
    data[-1] ^= 0x01  # damaged, but consolidation does not need it
    optim.write_bytes(bytes(data))
    out = export_checkpoint(ckpt, tmp_path / "hf")
    assert torch.equal(HFWeights(out).read("model.norm.weight"), exported("model.norm.weight"))


def test_a_piece_file_changed_in_place_is_refused_after_the_pass_and_an_earlier_export_stays(tmp_path):
    ckpt = make_checkpoint(tmp_path / "run")
    out = export_checkpoint(ckpt, tmp_path / "hf", max_shard_size="200B")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    rel = "shards/tp_rank_01_pp_rank_00/model.safetensors"
    data = bytearray((ckpt / rel).read_bytes())
    data[-3] ^= 0x10  # same size: only the hash can tell
    (ckpt / rel).write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"sha256 .*, the manifest records") as err:
        export_checkpoint(ckpt, out, max_shard_size="200B")
    assert str(ckpt / rel) in str(err.value)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # no .tmp left, nothing replaced


def test_a_manifest_giving_one_stored_tensor_to_two_tensors_is_refused(tmp_path):
    ckpt = make_checkpoint(tmp_path / "run")
    raw = json.loads((ckpt / MANIFEST).read_text())
    raw["tensors"]["lm_head.weight"]["pieces"] = [
        {**p, "key": "model.embed_tokens.weight"} for p in raw["tensors"]["lm_head.weight"]["pieces"]
    ]
    (ckpt / MANIFEST).write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="gives the bytes from offset .* to two pieces"):
        export_checkpoint(ckpt, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
