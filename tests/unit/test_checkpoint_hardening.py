"""Crafted or damaged checkpoints are refused before anything is read or written: paths that lead
out of a checkpoint or model folder, safetensors headers whose byte ranges do not fit the file or
the shape, weights of the wrong shape for a parameter, files whose sha256 changed, and
optimum-neuron metadata that does not fit the rank files on disk."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from neuron_parallel.checkpoint import export_checkpoint, validate_checkpoint
from neuron_parallel.checkpoint.format import COMPLETE, MANIFEST, Manifest, Piece, TensorEntry
from neuron_parallel.checkpoint.tensors import CheckpointTensors, HFWeights
from neuron_parallel.models.causal_lm import load_weights
from neuron_parallel.utils import sha256_file

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "optimum-neuron" / "ckpt_tp2_base"
W = torch.arange(32, dtype=torch.float32).reshape(8, 4)
B = torch.arange(4, dtype=torch.float32) / 7


def _listing(folder: Path, rel: str) -> dict:
    path = folder / rel
    return {"size": path.stat().st_size, "sha256": sha256_file(path)}


def make_checkpoint(run: Path, *, adapter: dict | None = None) -> Path:
    """A complete checkpoint of two tensors split over two tp ranks, written as the trainer does."""
    ckpt = run / "checkpoint-1"
    names = ("w.lora_A", "w.lora_B") if adapter else ("w.weight", "b.weight")
    shards = {
        "shards/tp_rank_00_pp_rank_00/model.safetensors": {names[0]: W[:4].clone(), names[1]: B.clone()},
        "shards/tp_rank_01_pp_rank_00/model.safetensors": {names[0]: W[4:].clone()},
    }
    for rel, tensors in shards.items():
        (ckpt / rel).parent.mkdir(parents=True)
        save_file(tensors, str(ckpt / rel), metadata={"format": "pt"})
    (ckpt / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 8}))
    files = {rel: _listing(ckpt, rel) for rel in [*shards, "config.json"]}
    first, second = list(shards)
    tensors = {
        names[0]: TensorEntry(
            shape=[8, 4],
            dtype="float32",
            kind="model",
            pieces=[Piece(first, names[0], [0, 0], [4, 4]), Piece(second, names[0], [4, 0], [4, 4])],
        ),
        names[1]: TensorEntry(shape=[4], dtype="float32", kind="model", pieces=[Piece(first, names[1], [0], [4])]),
    }
    manifest = Manifest(
        step=1, parallel={"tp": 2}, model_config={"vocab_size": 8}, files=files, tensors=tensors, adapter=adapter
    )
    (ckpt / MANIFEST).write_text(manifest.to_json())
    (ckpt / COMPLETE).write_text(json.dumps({"step": 1}))
    return ckpt


def edit_manifest(ckpt: Path, edit) -> None:
    raw = json.loads((ckpt / MANIFEST).read_text())
    edit(raw)
    (ckpt / MANIFEST).write_text(json.dumps(raw))


def snapshot(root: Path) -> dict[str, bytes | str]:
    """Every file (its bytes) and link (its target) under ``root``."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_symlink():
            out[str(p.relative_to(root))] = str(p.readlink())
        elif p.is_file():
            out[str(p.relative_to(root))] = p.read_bytes()
    return out


# -- paths that lead out of the folder ----------------------------------------------------------


@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink"])
def test_a_manifest_naming_a_file_outside_is_refused(tmp_path, how, opened):
    ckpt = make_checkpoint(tmp_path / "run")
    second = "shards/tp_rank_01_pp_rank_00/model.safetensors"
    outside = tmp_path / "run" / "outside.safetensors"
    shutil.copyfile(ckpt / second, outside)  # the same bytes: only the path is at fault
    rel = {"dotdot": "../outside.safetensors", "absolute": str(outside), "symlink": "shards/link.safetensors"}[how]
    if how == "symlink":
        (ckpt / rel).symlink_to(outside)

    def point_outside(raw):
        raw["files"][rel] = raw["files"].pop(second)
        raw["tensors"]["w.weight"]["pieces"][1]["file"] = rel

    edit_manifest(ckpt, point_outside)
    before = snapshot(tmp_path)

    with pytest.raises(ValueError, match="only a relative path inside the folder") as err:
        Manifest.load(ckpt)
    assert f"files entry {rel!r}" in str(err.value) and str(ckpt / MANIFEST) in str(err.value)
    [problem] = validate_checkpoint(ckpt)
    assert rel in problem and "outside" in problem
    with pytest.raises(ValueError, match="refusing to consolidate") as err:
        export_checkpoint(ckpt, tmp_path / "hf")
    assert rel in str(err.value)
    assert not (tmp_path / "hf").exists() and snapshot(tmp_path) == before
    assert all(outside != p.resolve() for p in opened) and not opened


def hf_dir(path: Path, weight_map: dict[str, str]) -> Path:
    path.mkdir(parents=True)
    save_file({"w.weight": W}, str(path / "model-00001-of-00001.safetensors"))
    index = {"metadata": {"total_size": W.numel() * 4}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return path


@pytest.mark.parametrize("target", ["../outside.safetensors", "/etc/passwd", "sub/../../outside.safetensors"])
def test_a_hugging_face_index_naming_a_file_outside_is_refused(tmp_path, target, opened):
    save_file({"w.weight": W}, str(tmp_path / "outside.safetensors"))
    model = hf_dir(tmp_path / "model", {"w.weight": target})
    with pytest.raises(ValueError, match="weight_map file") as err:
        HFWeights(model)
    assert repr(target) in str(err.value) and "only a relative path inside the folder" in str(err.value)
    assert not opened


def test_a_hugging_face_file_linked_outside_is_refused_but_a_hub_cache_snapshot_is_read(tmp_path):
    save_file({"w.weight": W}, str(tmp_path / "outside.safetensors"))
    model = hf_dir(tmp_path / "model", {"w.weight": "linked.safetensors"})
    (model / "linked.safetensors").symlink_to(tmp_path / "outside.safetensors")
    with pytest.raises(ValueError, match="resolves to .*outside.safetensors, outside"):
        HFWeights(model)
    # The hub cache links a snapshot's files into the repo's blobs/: that is where they live.
    repo = tmp_path / "hub" / "models--tiny"
    (repo / "blobs").mkdir(parents=True)
    save_file({"w.weight": W}, str(repo / "blobs" / "0123abcd"))
    snap = repo / "snapshots" / "rev"
    snap.mkdir(parents=True)
    (snap / "model.safetensors").symlink_to("../../blobs/0123abcd")
    assert torch.equal(HFWeights(snap).read("w.weight"), W)


# -- safetensors headers that do not fit the file ------------------------------------------------


def raw_safetensors(path: Path, header: dict, data: bytes, *, length: int | None = None) -> Path:
    raw = json.dumps(header).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)
    return path


def f32(shape, begin, end):
    return {"dtype": "F32", "shape": shape, "data_offsets": [begin, end]}


@pytest.mark.parametrize(
    "case, header, data, length, message",
    [
        ("huge header length", {"w.weight": f32([2], 0, 8)}, bytes(8), 1 << 62, "header length 4611686018427387904"),
        ("header past the end", {"w.weight": f32([2], 0, 8)}, bytes(8), 4096, "exceeds the file"),
        ("offsets past the end", {"w.weight": f32([4], 0, 16)}, bytes(8), None, r"\[0, 16\] beyond the 8 data"),
        ("shape beyond its span", {"w.weight": f32([4], 0, 8), "b.weight": f32([2], 8, 16)}, bytes(16), None,
         r"F32 \[4\], 16 bytes, but its data_offsets \[0, 8\] span 8"),
        ("negative offset", {"w.weight": f32([2], -8, 0)}, bytes(8), None, "non-negative integers"),
        ("overlapping tensors", {"w.weight": f32([2], 0, 8), "b.weight": f32([2], 4, 12)}, bytes(16), None,
         "overlap"),
    ],
)  # fmt: skip
def test_a_safetensors_header_that_does_not_fit_is_refused(tmp_path, case, header, data, length, message):
    model = tmp_path / "model"
    path = raw_safetensors(model / "model.safetensors", header, data, length=length)
    before = path.read_bytes()
    with pytest.raises(ValueError, match=message) as err:
        HFWeights(model)
    assert str(path) in str(err.value)
    assert path.read_bytes() == before


def test_a_checkpoint_shard_whose_header_lies_is_refused_when_consolidated(tmp_path):
    """A shard rewritten with a consistent manifest (sizes and digests updated) but a header whose
    first tensor claims the next tensor's bytes: the read stops at the header."""
    ckpt = make_checkpoint(tmp_path / "run")
    rel = "shards/tp_rank_00_pp_rank_00/model.safetensors"
    raw_safetensors(
        ckpt / rel, {"b.weight": f32([4], 0, 16), "w.weight": f32([8, 4], 16, 80)}, bytes(80)
    )  # w claims 8 rows, the manifest's piece is 4: 64 bytes of it would be someone else's
    edit_manifest(ckpt, lambda raw: raw["files"].update({rel: _listing(ckpt, rel)}))
    with pytest.raises(ValueError, match=r"span 64 bytes"):
        export_checkpoint(ckpt, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


# -- weights of another shape than the parameter -------------------------------------------------


def test_hugging_face_weights_of_another_shape_than_the_parameter_are_refused(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    save_file({"w.weight": W}, str(model / "model.safetensors"))  # 8 × 4
    weights = HFWeights(model)

    class Stage(torch.nn.Module):
        def __init__(self, rows, cols):
            super().__init__()
            self.w = torch.nn.Linear(cols, rows, bias=False)

    for rows, cols in ((4, 8), (4, 4)):  # a slice past the stored columns; a slice that would fit
        with pytest.raises(
            ValueError,
            match=rf"w.weight is stored with shape \[8, 4\], the model's parameter has shape \[{rows}, {cols}\]",
        ):
            load_weights(Stage(rows, cols), weights, tied=False)
    with pytest.raises(
        ValueError, match=r"stored with shape \[8, 4\]; the slice at offsets \[0, 0\] of shape \[4, 8\]"
    ):
        weights.read("w.weight", [0, 0], [4, 8])
    assert torch.equal(weights.read("w.weight", [2, 0], [2, 4], global_shape=[8, 4]), W[2:4])


def test_checkpoint_tensors_of_another_shape_than_the_parameter_are_refused(tmp_path):
    ckpt = make_checkpoint(tmp_path / "run")
    tensors = CheckpointTensors(ckpt)
    with pytest.raises(ValueError, match=r"w.weight has global shape \[8, 4\], the model's parameter \[8, 2\]"):
        tensors.read("w.weight", [0, 0], [8, 2], global_shape=[8, 2])
    assert torch.equal(tensors.read("w.weight", global_shape=[8, 4]), W)


# -- checksums -----------------------------------------------------------------------------------


def flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_flipped_byte_is_refused_by_consolidation(tmp_path):
    ckpt = make_checkpoint(tmp_path / "run")
    rel = "shards/tp_rank_01_pp_rank_00/model.safetensors"
    recorded = json.loads((ckpt / MANIFEST).read_text())["files"][rel]["sha256"]
    flip_last_byte(ckpt / rel)
    before = snapshot(tmp_path)
    with pytest.raises(ValueError, match="sha256") as err:
        export_checkpoint(ckpt, tmp_path / "hf")
    message = str(err.value)
    assert str(ckpt / rel) in message and recorded in message and sha256_file(ckpt / rel) in message
    assert "use an earlier checkpoint" in message and "neuron-flows validate" in message
    assert not (tmp_path / "hf").exists() and snapshot(tmp_path) == before


def test_a_flipped_byte_is_refused_by_adapter_export(tmp_path):
    lora = {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj"], "modules_to_save": []}
    adapter = {"lora": lora, "base_model": {"name_or_path": str(tmp_path / "base"), "sha256": "0" * 64}}
    ckpt = make_checkpoint(tmp_path / "run", adapter=adapter)
    assert (export_checkpoint(ckpt, tmp_path / "ok") / "adapter_model.safetensors").is_file()
    flip_last_byte(ckpt / "shards/tp_rank_00_pp_rank_00/model.safetensors")
    with pytest.raises(ValueError, match="sha256 .*, the manifest records"):
        export_checkpoint(ckpt, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_an_intact_checkpoint_consolidates_exactly(tmp_path):
    ckpt = make_checkpoint(tmp_path / "run")
    out = export_checkpoint(ckpt, tmp_path / "hf", max_shard_size=64)  # two files and an index
    weights = HFWeights(out)
    assert torch.equal(weights.read("w.weight"), W) and torch.equal(weights.read("b.weight"), B)
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == [
        "config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ]
    assert not list(out.glob("*.tmp*"))


def test_the_cli_refuses_a_flipped_byte_with_exit_2_and_no_traceback(tmp_path):
    ckpt = make_checkpoint(tmp_path / "run")
    flip_last_byte(ckpt / "config.json")
    cmd = [str(ROOT / ".venv" / "bin" / "neuron-flows"), "consolidate", str(ckpt), str(tmp_path / "hf")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and f"{ckpt / 'config.json'}: sha256" in proc.stderr
    assert not (tmp_path / "hf").exists()


# -- optimum-neuron metadata that does not fit the files -----------------------------------------


def crafted_fixture(tmp_path: Path, edit) -> Path:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(FIXTURE, ckpt)
    meta_path = ckpt / "shards" / "mp_metadata_pp_rank_0.json"
    meta = json.loads(meta_path.read_text())
    edit(meta["parameters"])
    meta_path.write_text(json.dumps(meta))
    return ckpt


def set_all(key, value):
    def edit(params):
        for p in params.values():
            if p.get("tensor_model_parallel"):
                p[key] = value

    return edit


@pytest.mark.parametrize(
    "num_partitions, message",
    [
        (10**9, "records num_partitions=1000000000; a tensor-parallel degree is an integer from 1 to 4096"),
        (4, "dp_rank_00_tp_rank_02_pp_rank_00.pt: missing"),
        (1, "tp_rank 1 exists, but the metadata records num_partitions=1"),
        ("2", "records num_partitions='2'"),
    ],
)
def test_optimum_neuron_num_partitions_that_do_not_fit_the_rank_files_are_refused(tmp_path, num_partitions, message):
    ckpt = crafted_fixture(tmp_path, set_all("num_partitions", num_partitions))
    before = snapshot(ckpt)
    with pytest.raises(ValueError, match="refusing to consolidate") as err:
        export_checkpoint(ckpt, tmp_path / "hf")
    assert message in str(err.value)
    assert not (tmp_path / "hf").exists() and snapshot(ckpt) == before


def test_optimum_neuron_num_partitions_disagreeing_between_parameters_are_refused(tmp_path):
    def edit(params):
        params["model.embed_tokens.weight"]["num_partitions"] = 8

    ckpt = crafted_fixture(tmp_path, edit)
    with pytest.raises(ValueError, match=r"records num_partitions \[2, 8\]"):
        export_checkpoint(ckpt, tmp_path / "hf")


@pytest.mark.parametrize("stride, message", [(3, "partition_stride=3 does not divide dim 0"), (-1, "not a positive")])
def test_optimum_neuron_partition_stride_that_does_not_divide_is_refused(tmp_path, stride, message):
    def edit(params):
        params["model.embed_tokens.weight"]["partition_stride"] = stride  # 128 rows per rank

    ckpt = crafted_fixture(tmp_path, edit)
    with pytest.raises(ValueError, match="refusing to consolidate") as err:
        export_checkpoint(ckpt, tmp_path / "hf")
    assert f"model.embed_tokens.weight: partition_stride={stride} " in str(err.value) and message in str(err.value)
    assert not (tmp_path / "hf").exists()


def test_an_optimum_neuron_rank_file_linked_outside_is_refused(tmp_path):
    ckpt = crafted_fixture(tmp_path, lambda params: None)
    rank = ckpt / "shards" / "model" / "dp_rank_00_tp_rank_01_pp_rank_00.pt"
    outside = tmp_path / "elsewhere.pt"
    rank.rename(outside)
    rank.symlink_to(outside)
    with pytest.raises(ValueError, match="rank file 'model/dp_rank_00_tp_rank_01_pp_rank_00.pt' resolves to"):
        export_checkpoint(ckpt, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
