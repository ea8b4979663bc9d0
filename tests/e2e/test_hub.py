"""neuron_parallel.hub against LocalHub: the real huggingface_hub client doing real HTTP on loopback.

HF_HUB_DISABLE_XET is deliberately *not* set here. huggingface_hub reads it once, at import, and
upload_model must work without it: for a non-public endpoint it switches Xet off itself for the call
(see neuron_parallel/hub.py). Downloads need nothing because LocalHub never advertises Xet.
Setting the variable here would hide a regression in upload_model instead of catching it.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from huggingface_hub import HfApi, ModelCard, constants, snapshot_download
from huggingface_hub.errors import HfHubHTTPError
from huggingface_hub.hf_api import RepoFile
from safetensors.torch import save_file

from neuron_parallel.hub import HubCommit, upload_model, write_model_card

from ..hub_server import DEFAULT_USERS, LocalHub

REPO_ID = f"{next(iter(DEFAULT_USERS.values()))}/tiny-llama-ft"  # LocalHub's default user owns it


@pytest.fixture(autouse=True)
def no_saved_login(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Make token=None mean "anonymous", whatever login the machine running the tests has."""
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-saved-token"))


@pytest.fixture
def hub(tmp_path: Path) -> Iterator[LocalHub]:
    with LocalHub(tmp_path / "hub") as server:
        yield server


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """A small save_pretrained-like directory: config, ~3 MiB of safetensors, tokenizer, a nested file."""
    root = tmp_path / "model"
    (root / "training").mkdir(parents=True)
    (root / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "vocab_size": 128}))
    weights = torch.randn(768, 1024, generator=torch.Generator().manual_seed(0))  # 3 MiB of fp32
    save_file({"model.embed_tokens.weight": weights}, str(root / "model.safetensors"))
    (root / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"type": "BPE", "vocab": {"a": 0}}}))
    (root / "training" / "metrics.jsonl").write_text('{"step": 1, "loss": 2.5}\n{"step": 2, "loss": 2.1}\n')
    return root


def digests(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def card_for(model_dir: Path, repo_id: str | None = REPO_ID, base_model: str = "TinyLlama/TinyLlama-1.1B") -> Path:
    return write_model_card(
        model_dir,
        repo_id=repo_id,
        base_model=base_model,
        datasets=["tatsu-lab/alpaca"],
        summary={"steps": 2, "final loss": 2.1, "parallel layout": "tp=2 pp=1 dp=2"},
    )


def test_upload_then_snapshot_download_is_byte_identical(hub: LocalHub, model_dir: Path, tmp_path: Path) -> None:
    (model_dir / "loss_curve.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)))
    write_model_card(
        model_dir,
        repo_id=REPO_ID,
        base_model="TinyLlama/TinyLlama-1.1B",
        datasets=["tatsu-lab/alpaca"],
        summary={"steps": 2, "final loss": 2.1},
        config={"train": {"max_steps": 2}},
        loss_curve="loss_curve.png",
        license="apache-2.0",
    )
    commit = upload_model(model_dir, repo_id=REPO_ID, endpoint=hub.url, token=hub.token)

    assert isinstance(commit, HubCommit) and commit.repo_id == REPO_ID
    assert len(commit.revision) == 40 and commit.url == f"{hub.url}/{REPO_ID}/commit/{commit.revision}"
    snapshot = Path(snapshot_download(REPO_ID, endpoint=hub.url, token=hub.token, cache_dir=tmp_path / "cache"))
    expected, got = digests(model_dir), digests(snapshot)
    assert {"README.md", "model.safetensors", "training/metrics.jsonl"} <= expected.keys()
    assert got.pop(".gitattributes")  # the server's initial commit, as on the Hub
    assert got == expected
    assert snapshot.name == commit.revision  # the snapshot is the commit upload_model reported
    card = ModelCard.load(snapshot / "README.md")  # the card as the Hub serves it, with its loss curve beside it
    assert (card.data.base_model, card.data.datasets, card.data.license) == (
        "TinyLlama/TinyLlama-1.1B",
        ["tatsu-lab/alpaca"],
        "apache-2.0",
    )
    assert card.data.library_name == "transformers" and "neuron-flows" in card.data.tags
    assert "![loss curve](loss_curve.png)" in card.text and (snapshot / "loss_curve.png").is_file()

    # The safetensors went through git-LFS (preupload -> batch -> PUT), the JSON files inline.
    tree = HfApi(endpoint=hub.url).list_repo_tree(REPO_ID, recursive=True)
    files = {entry.path: entry for entry in tree if isinstance(entry, RepoFile)}
    assert files["model.safetensors"].lfs is not None and files["config.json"].lfs is None


def test_second_upload_creates_a_new_revision(hub: LocalHub, model_dir: Path, tmp_path: Path) -> None:
    first = upload_model(model_dir, repo_id=REPO_ID, endpoint=hub.url, token=hub.token)
    (model_dir / "training" / "metrics.jsonl").write_text('{"step": 3, "loss": 1.9}\n')
    second = upload_model(model_dir, repo_id=REPO_ID, endpoint=hub.url, token=hub.token, commit_message="Step 3")

    assert second.revision != first.revision
    commits = HfApi(endpoint=hub.url, token=hub.token).list_repo_commits(REPO_ID)
    assert [c.commit_id for c in commits[:2]] == [second.revision, first.revision]
    assert commits[0].title == "Step 3" and commits[-1].title == "initial commit"
    old = snapshot_download(REPO_ID, revision=first.revision, endpoint=hub.url, cache_dir=tmp_path / "cache")
    assert '"step": 2' in (Path(old) / "training" / "metrics.jsonl").read_text()  # old revision stays readable


@pytest.mark.parametrize("token", [None, "hf_not_a_valid_token"], ids=["anonymous", "bad-token"])
def test_upload_without_valid_token_is_rejected(hub: LocalHub, model_dir: Path, token: str | None) -> None:
    with pytest.raises(HfHubHTTPError) as err:
        upload_model(model_dir, repo_id=REPO_ID, endpoint=hub.url, token=token)
    assert err.value.response is not None and err.value.response.status_code == 401
    assert not HfApi(endpoint=hub.url, token=hub.token).repo_exists(REPO_ID)


@pytest.mark.parametrize("layout", ["missing", "no-config"])
def test_upload_refuses_a_dir_that_is_not_a_model_before_any_http(tmp_path: Path, layout: str) -> None:
    target = tmp_path / "not-a-model"
    if layout == "no-config":
        target.mkdir()
        (target / "model.safetensors").write_bytes(b"\0" * 16)
    # Port 9 (discard) has no listener: any HTTP attempt would raise a connection error, not ValueError.
    with pytest.raises(ValueError, match="config.json" if layout == "no-config" else "does not exist") as err:
        upload_model(target, repo_id=REPO_ID, endpoint="http://127.0.0.1:9", token="unused")
    assert str(target) in str(err.value)


@pytest.mark.skipif(importlib.util.find_spec("hf_xet") is None, reason="Xet is only used when hf_xet is installed")
def test_upload_to_a_non_hub_endpoint_works_with_xet_enabled(
    hub: LocalHub, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As in a default install: hf_xet importable, HF_HUB_DISABLE_XET unset when huggingface_hub was imported.
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", False)
    commit = upload_model(model_dir, repo_id=REPO_ID, endpoint=hub.url, token=hub.token)
    assert commit.revision
    assert constants.HF_HUB_DISABLE_XET is False  # the override ends with the call


def test_model_card_metadata_and_body(model_dir: Path, tmp_path: Path) -> None:
    card = ModelCard.load(card_for(model_dir))
    assert card.data.library_name == "transformers" and "neuron-flows" in card.data.tags
    assert card.data.base_model == "TinyLlama/TinyLlama-1.1B" and card.data.datasets == ["tatsu-lab/alpaca"]
    assert "| final loss | 2.1 |" in card.text and "| parallel layout | tp=2 pp=1 dp=2 |" in card.text
    assert f'AutoModelForCausalLM.from_pretrained("{REPO_ID}")' in card.text

    local_base = tmp_path / "base-checkpoint"
    local_base.mkdir()
    card = ModelCard.load(
        write_model_card(
            model_dir, repo_id=None, base_model=str(local_base), datasets=[str(tmp_path / "train.jsonl")], summary={}
        )
    )
    assert card.data.base_model is None and card.data.datasets is None  # local paths stay out of the metadata
    # No repo id yet: the model by its folder's name, never a path of this machine.
    assert f'from_pretrained("path/to/{model_dir.name}")' in card.text and str(tmp_path) not in card.text


def test_adapter_card_says_peft_names_the_base_and_uploads_with_the_merged_folder(
    hub: LocalHub, model_dir: Path, tmp_path: Path
) -> None:
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    config = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    save_file({"base_model.model.lm_head.weight": torch.zeros(4, 4)}, str(adapter / "adapter_model.safetensors"))
    (adapter / "merged").mkdir()
    (adapter / "merged" / "config.json").write_text((model_dir / "config.json").read_text())

    card = ModelCard.load(card_for(adapter))
    assert card.data.library_name == "peft" and "lora" in card.data.tags
    assert card.data.base_model == "TinyLlama/TinyLlama-1.1B"
    assert "A LoRA adapter (r=8, alpha=16, on q_proj, v_proj)" in card.text
    assert 'base = AutoModelForCausalLM.from_pretrained("TinyLlama/TinyLlama-1.1B")' in card.text
    assert f'PeftModel.from_pretrained(base, "{REPO_ID}")' in card.text and 'subfolder="merged"' in card.text

    upload_model(adapter, repo_id=REPO_ID, endpoint=hub.url, token=hub.token)
    snap = Path(snapshot_download(REPO_ID, endpoint=hub.url, token=hub.token, cache_dir=tmp_path / "cache"))
    assert {"adapter_config.json", "adapter_model.safetensors", "README.md", "merged/config.json"} <= set(digests(snap))


def test_local_hub_speaks_the_hub_error_shapes(hub: LocalHub, model_dir: Path) -> None:
    upload_model(model_dir, repo_id=REPO_ID, endpoint=hub.url, token=hub.token)

    def call(method: str, path: str, body: bytes | None = None, **headers: str) -> tuple[int, dict[str, str], bytes]:
        request = urllib.request.Request(hub.url + path, data=body, method=method, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return response.status, dict(response.headers), response.read()
        except urllib.error.HTTPError as err:
            return err.code, dict(err.headers), err.read()

    auth = {"Authorization": f"Bearer {hub.token}"}
    create = json.dumps({"name": REPO_ID.split("/")[1], "type": "model"}).encode()
    assert call("POST", "/api/repos/create", create, **auth)[0] == 409
    assert call("POST", "/api/repos/create", create)[0] == 401
    assert call("GET", "/api/models/nobody/nothing")[1]["X-Error-Code"] == "RepoNotFound"
    assert call("GET", f"/api/models/{REPO_ID}/revision/no-such-branch")[1]["X-Error-Code"] == "RevisionNotFound"
    assert call("HEAD", f"/{REPO_ID}/resolve/main/absent.bin")[1]["X-Error-Code"] == "EntryNotFound"

    status, headers, data = call("GET", f"/{REPO_ID}/resolve/main/model.safetensors", Range="bytes=10-19")
    assert status == 206 and headers["Content-Range"].startswith("bytes 10-19/")
    assert data == (model_dir / "model.safetensors").read_bytes()[10:20]

    for bad_path in ("../escape.txt", "/etc/passwd", "a/../../b"):
        ndjson = b"\n".join(
            json.dumps(line).encode()
            for line in [
                {"key": "header", "value": {"summary": "evil"}},
                {
                    "key": "file",
                    "value": {"path": bad_path, "content": base64.b64encode(b"x").decode(), "encoding": "base64"},
                },
            ]
        )
        assert call("POST", f"/api/models/{REPO_ID}/commit/main", ndjson, **auth)[0] == 400, bad_path
    assert call("POST", f"/api/models/{REPO_ID}/commit/main", b'{"key": "header", "value": {}}\n')[0] == 401

    # LFS: the batch hands out a pre-signed URL; the PUT must carry exactly the announced bytes.
    oid = hashlib.sha256(b"hello").hexdigest()
    batch = json.dumps({"operation": "upload", "objects": [{"oid": oid, "size": 5}]}).encode()
    assert call("POST", f"/{REPO_ID}.git/info/lfs/objects/batch", batch)[0] == 401
    status, _, answer = call("POST", f"/{REPO_ID}.git/info/lfs/objects/batch", batch, **auth)
    assert status == 200
    href = json.loads(answer)["objects"][0]["actions"]["upload"]["href"].removeprefix(hub.url)
    assert call("PUT", href.replace("sig=", "sig=0"), b"hello")[0] == 403
    assert call("PUT", href, b"jello")[1]["X-Error-Code"] == "BadDigest"
    assert call("PUT", href, b"hello")[0] == 200
