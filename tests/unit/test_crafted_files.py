"""Crafted folders and files that try to make a reader reach further or work longer than it
should: links that lead out of a model folder (the Hugging Face cache's ``blobs`` folder among
them), JSON files far larger than any a checkpoint holds, a FIFO where a file should be, and a
manifest with tens of thousands of pieces whose coverage must still be checked in a moment."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
from safetensors.torch import save_file

from neuron_parallel.checkpoint import export_checkpoint, validate_checkpoint
from neuron_parallel.checkpoint import validate as validate_module
from neuron_parallel.checkpoint.format import MANIFEST, Manifest, Piece, TensorEntry, user_model_files
from neuron_parallel.checkpoint.tensors import HFWeights
from neuron_parallel.utils import MAX_JSON_BYTES

from .test_checkpoint_hardening import ROOT, W, crafted_fixture, hf_dir, make_checkpoint

TOO_BIG = f"{MAX_JSON_BYTES + 1} bytes, more than the {MAX_JSON_BYTES} bytes"


def hub_snapshot(tmp_path: Path) -> tuple[Path, Path]:
    """(repo, snapshot) folders laid out as the Hugging Face hub cache lays them out, no blobs yet."""
    repo = tmp_path / "hub" / "models--org--tiny"
    snap = repo / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    return repo, snap


# -- links that lead out of a model folder -------------------------------------------------------


@pytest.mark.parametrize("blobs_to", ["/", "elsewhere"])
def test_a_hub_cache_whose_blobs_folder_leads_out_of_its_repo_is_refused(tmp_path, blobs_to, opened):
    secret = tmp_path / "elsewhere" / "secret.safetensors"
    secret.parent.mkdir()
    save_file({"w.weight": W}, str(secret))
    repo, snap = hub_snapshot(tmp_path)
    target = Path(blobs_to) if blobs_to == "/" else secret.parent
    (repo / "blobs").symlink_to(target)
    # What the cache writes, ../../blobs/<name>; through blobs -> / that name reaches any file.
    (snap / "model.safetensors").symlink_to(Path("../../blobs") / secret.relative_to(target))
    assert (snap / "model.safetensors").resolve() == secret.resolve()
    with pytest.raises(ValueError) as err:
        HFWeights(snap)
    message = str(err.value)
    assert f"blobs leads to {target.resolve()}, outside" in message, message
    assert "download the model again, or copy the files of" in message, message
    assert not opened
    with pytest.raises(ValueError, match="blobs leads to"):
        user_model_files(snap)


def test_a_hub_cache_snapshot_is_read_through_its_own_blobs_even_when_linked_to(tmp_path):
    repo, snap = hub_snapshot(tmp_path)
    (repo / "store").mkdir()
    (repo / "blobs").symlink_to("store")  # a link, but one that stays inside the repo
    save_file({"w.weight": W}, str(repo / "store" / "aaaa"))
    (repo / "store" / "bbbb").write_text('{"model_type": "llama"}')
    (snap / "model.safetensors").symlink_to("../../blobs/aaaa")
    (snap / "config.json").symlink_to("../../blobs/bbbb")
    alias = tmp_path / "my-model"
    alias.symlink_to(snap)  # a model path that is itself a link to the snapshot
    for model in (snap, alias):
        assert HFWeights(model).read("w.weight").equal(W)
        assert [p.name for p in user_model_files(model)] == ["config.json"]


def test_a_model_folder_file_linked_outside_is_refused_before_export_writes(tmp_path):
    ckpt = make_checkpoint(tmp_path / "run")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 8}))
    secret = tmp_path / "secret.txt"
    secret.write_text("token=hf_not_for_upload")
    (model / "tokenizer.json").symlink_to(secret)
    with pytest.raises(ValueError) as err:
        export_checkpoint(ckpt, tmp_path / "hf", model_dir=model)
    message = str(err.value)
    assert f"{model}: model file 'tokenizer.json' resolves to {secret.resolve()}, outside {model}" in message
    assert f"copy the file into {model} in place of the link" in message
    assert not (tmp_path / "hf").exists()
    # The same folder with the file copied in exports, the file with it.
    (model / "tokenizer.json").unlink()
    (model / "tokenizer.json").write_text("{}")
    out = export_checkpoint(ckpt, tmp_path / "hf", model_dir=model)
    assert (out / "tokenizer.json").read_text() == "{}"


def test_the_cli_refuses_a_hub_cache_blobs_link_to_root_with_exit_2(tmp_path):
    ckpt = make_checkpoint(tmp_path / "run")
    repo, snap = hub_snapshot(tmp_path)
    (repo / "blobs").symlink_to("/")
    (snap / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 8}))
    cmd = [str(ROOT / ".venv" / "bin" / "neuron-flows"), "consolidate", str(ckpt), str(tmp_path / "hf")]
    proc = subprocess.run([*cmd, "--model-dir", str(snap)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and f"{repo / 'blobs'} leads to /, outside" in proc.stderr, proc.stderr
    assert not (tmp_path / "hf").exists()


# -- JSON files no checkpoint holds ----------------------------------------------------------------


def oversize(path: Path) -> None:
    """Make ``path`` one byte longer than any JSON file is read (sparse: no disk, no time)."""
    with open(path, "r+b" if path.exists() else "wb") as f:
        f.truncate(MAX_JSON_BYTES + 1)


def test_an_oversized_manifest_is_refused_without_being_read(tmp_path):
    ckpt = make_checkpoint(tmp_path / "run")
    oversize(ckpt / MANIFEST)
    with pytest.raises(ValueError, match=f"{ckpt / MANIFEST}: {TOO_BIG}"):
        Manifest.load(ckpt)
    (problem,) = validate_checkpoint(ckpt)
    assert problem.startswith(f"{ckpt / MANIFEST}: unreadable ({ckpt / MANIFEST}: {TOO_BIG}"), problem
    with pytest.raises(ValueError, match=f"refusing to consolidate {ckpt}: .*{TOO_BIG}"):
        export_checkpoint(ckpt, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_an_oversized_hugging_face_index_is_refused(tmp_path, opened):
    model = hf_dir(tmp_path / "model", {"w.weight": "model-00001-of-00001.safetensors"})
    oversize(model / "model.safetensors.index.json")
    with pytest.raises(ValueError, match=f"model.safetensors.index.json: {TOO_BIG}"):
        HFWeights(model)
    assert not opened


@pytest.mark.parametrize("name", ["shards/mp_metadata_pp_rank_0.json", "config.json"])
def test_oversized_optimum_neuron_json_is_refused(tmp_path, name):
    ckpt = crafted_fixture(tmp_path, lambda params: None)
    oversize(ckpt / name)
    with pytest.raises(ValueError, match=f"{ckpt / name}: {TOO_BIG}"):
        export_checkpoint(ckpt, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


@pytest.mark.timeout(30)
def test_a_fifo_in_place_of_a_manifest_is_refused_at_once(tmp_path):
    ckpt = make_checkpoint(tmp_path / "run")
    (ckpt / MANIFEST).unlink()
    os.mkfifo(ckpt / MANIFEST)  # opening it for reading would wait for a writer forever
    with pytest.raises(ValueError, match=f"{ckpt / MANIFEST}: not a regular file"):
        Manifest.load(ckpt)


def test_a_manifest_that_is_not_an_object_is_refused(tmp_path):
    ckpt = make_checkpoint(tmp_path / "run")
    (ckpt / MANIFEST).write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"is not a neuron-flows-checkpoint manifest \(format='list'\)"):
        Manifest.load(ckpt)


# -- coverage of many pieces -----------------------------------------------------------------------


def many_pieces(run: Path, pieces: list[Piece], shape: list[int]) -> Path:
    """A complete checkpoint whose one tensor has ``pieces``, all in one listed file (quick
    validation reads no tensor data)."""
    ckpt = run / "checkpoint-1"
    ckpt.mkdir(parents=True)
    (ckpt / "data.bin").write_bytes(b"\0" * 16)
    files = {"data.bin": {"size": 16, "sha256": "0" * 64}}
    manifest = Manifest(
        step=1,
        parallel={},
        model_config={},
        files=files,
        tensors={"w": TensorEntry(shape=shape, dtype="float32", kind="model", pieces=pieces)},
    )
    (ckpt / MANIFEST).write_text(manifest.to_json())
    (ckpt / "COMPLETE").write_text("{}")
    return ckpt


def test_twenty_thousand_pieces_are_checked_in_well_under_a_second_and_overlaps_still_found(tmp_path):
    shape = [200, 400]  # 200 × 100 pieces of 1 × 4
    tiles = [Piece("data.bin", f"p{i}.{j}", [i, 4 * j], [1, 4]) for i in range(200) for j in range(100)]
    message = (
        "w: pieces cover 80000 elements of 80000 (global shape [200, 400]); every element must be covered exactly once"
    )
    cases = {
        "tiled": (tiles, []),
        "one piece on its neighbour": ([Piece("data.bin", "x", [0, 4], [1, 4]), *tiles[1:]], [message]),
        "a piece across two others, one place left uncovered": (
            [*tiles[:-2], Piece("data.bin", "x", [0, 2], [1, 4]), Piece("data.bin", "y", [199, 392], [1, 4])],
            [message],
        ),
    }
    for what, (pieces, expected) in cases.items():
        assert len(pieces) == 20_000
        t0 = time.process_time()  # this process's CPU time: other processes' load does not count
        covered = validate_module._covers_exactly_once(pieces, shape)
        elapsed = time.process_time() - t0  # a pairwise check takes minutes
        assert covered == (not expected) and elapsed < 1.0, f"{what}: {elapsed:.2f} s for {len(pieces)} pieces"
    # And through validation, as written to disk and read back.
    ckpt = many_pieces(tmp_path, cases["one piece on its neighbour"][0], shape)
    assert validate_checkpoint(ckpt, quick=True, check_model=False) == [message]


@pytest.mark.parametrize(
    "pieces, covered",
    [
        ([([0], [3]), ([3], [3])], True),
        ([([0], [4]), ([2], [2])], False),  # overlap, sizes still add up
        ([([0], [3]), ([4], [3])], False),  # one reaches outside, one element left uncovered
        ([([0, 0, 0], [2, 3, 4]), ([2, 0, 0], [2, 3, 2]), ([2, 0, 2], [2, 3, 2])], True),
        ([([0, 0, 0], [2, 3, 4]), ([2, 0, 0], [2, 3, 2]), ([1, 0, 2], [2, 3, 2])], False),
        ([([0, 0], [4, 6]), ([1, 1], [0, 3])], True),  # an empty piece holds nothing
    ],
)
def test_coverage_of_small_layouts(tmp_path, pieces, covered):
    shape = [6] if len(pieces[0][0]) == 1 else ([4, 6] if len(pieces[0][0]) == 2 else [4, 3, 4])
    listed = [Piece("data.bin", f"k{i}", o, s) for i, (o, s) in enumerate(pieces)]
    problems = validate_checkpoint(many_pieces(tmp_path, listed, shape), quick=True, check_model=False)
    assert any(p.endswith("every element must be covered exactly once") for p in problems) is not covered, problems
