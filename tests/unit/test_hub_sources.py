"""Hub names resolve to a commit or are refused with the key, the id and the fix; a dataset that
``datasets`` cached under the same name from a local folder is never taken for the Hub dataset;
and a run resumes only from checkpoints of the same model and data."""

from __future__ import annotations

from pathlib import Path

import pytest
from huggingface_hub import constants

from neuron_parallel.checks import pin_hub_revisions, resolve_hub_repo
from neuron_parallel.config import DataConfig, ModelConfig
from neuron_parallel.data import tokenize_data, tokenize_dataset
from neuron_parallel.lineage import SourcesChanged, check_same_sources

from ..conftest import HF_CACHES, UNREACHABLE_HUB
from ..hub_server import LocalHub


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A Hub stand-in that huggingface_hub reads from (``HF_ENDPOINT``)."""
    with LocalHub(tmp_path / "hub") as server:
        monkeypatch.setattr(constants, "ENDPOINT", server.url)
        yield server


@pytest.fixture
def wikitext_left_in_the_datasets_cache(tiny_world, tmp_path) -> Path:
    """The tiny world's local folder called ``wikitext``, loaded once, so that ``datasets`` keeps a
    prepared copy of it under the name ``wikitext`` in its cache, as a test run or a user's
    experiment leaves it."""
    tokenize_dataset(
        source=tiny_world["wikitext"],
        config="wikitext-2-raw-v1",
        tokenizer_dir=tiny_world["model"],
        block_size=32,
        cache_dir=tmp_path / "local-rows",
    )
    copy = Path(HF_CACHES) / "datasets" / "wikitext"
    assert copy.is_dir(), "datasets did not keep its copy under the dataset's name"
    return copy


def _offline(monkeypatch) -> None:
    import datasets.config

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)


@pytest.mark.parametrize("how", ["offline", "unreachable"])
def test_a_same_named_dataset_in_the_datasets_cache_is_refused(
    tiny_world, tmp_path, monkeypatch, wikitext_left_in_the_datasets_cache, how
):
    """``load_dataset("wikitext", ...)`` without the Hub takes the cached copy of the local folder;
    the data loading refuses it, naming the key, the id, the copy it leaves alone and the fix."""
    if how == "offline":
        _offline(monkeypatch)
        from datasets import load_dataset

        taken = load_dataset("wikitext", "wikitext-2-raw-v1", split="train")  # what datasets alone does
        assert len(taken) > 0
    else:
        monkeypatch.setattr(constants, "ENDPOINT", UNREACHABLE_HUB)
    data = DataConfig(source="wikitext", config="wikitext-2-raw-v1", block_size=32, cache_dir=str(tmp_path / "rows"))
    with pytest.raises(ValueError) as refused:
        tokenize_data(data, tiny_world["model"])
    message = str(refused.value)
    assert message.startswith("data.source=wikitext: "), message
    assert ("HF_HUB_OFFLINE=1" if how == "offline" else "cannot be reached") in message
    assert f"{wikitext_left_in_the_datasets_cache} holds a dataset of that name" in message
    assert "set HF_HUB_OFFLINE=1 with a cache that holds it" in message and "local data files" in message
    assert not (tmp_path / "rows").exists()


def _dataset_repo(hub: LocalHub, tiny_world, tmp_path) -> tuple[str, list[str]]:
    """A dataset repo on the stand-in with two commits of the tiny wikitext folder (the second
    with other text); its id and the two commits."""
    from huggingface_hub import HfApi

    from neuron_parallel.tiny import write_wikitext_folder

    api = HfApi(endpoint=hub.url, token=hub.token)
    repo = f"{hub.user}/wikitext"
    api.create_repo(repo, repo_type="dataset")
    second = write_wikitext_folder(["The second commit's text.\n\nIts second paragraph."] * 30, tmp_path / "second")
    commits = []
    for folder in (tiny_world["wikitext"], second):
        with pytest.MonkeyPatch.context() as m:  # the stand-in takes LFS uploads, not Xet ones
            m.setattr(constants, "HF_HUB_DISABLE_XET", True)
            commits.append(api.upload_folder(repo_id=repo, repo_type="dataset", folder_path=str(folder)).oid)
    return repo, commits


def test_hub_names_resolve_to_commits_and_local_paths_stay(hub, tiny_world, tmp_path):
    """Unpinned, a Hub dataset resolves to its newest commit, a branch to its head, a commit to
    itself; a local model and a local entry of a weighted list stay as they are."""
    repo, (first, second) = _dataset_repo(hub, tiny_world, tmp_path)
    local = ModelConfig(name_or_path=tiny_world["model"])
    for asked, commit in ((None, second), ("main", second), (first, first)):
        model, data = pin_hub_revisions(
            local, DataConfig(source=repo, config="wikitext-2-raw-v1", revision=asked), warn=pytest.fail
        )
        assert (model, data.revision) == (local, commit)
    mixed = DataConfig(source=[tiny_world["corpus"], repo], weights=[1, 1], revision=[None, first])
    _, data = pin_hub_revisions(local, mixed, warn=pytest.fail)
    assert data.revision == [None, first]


def test_missing_repo_and_revision_are_refused_with_key_id_and_fix(hub, tiny_world, tmp_path):
    repo, _ = _dataset_repo(hub, tiny_world, tmp_path)
    with pytest.raises(ValueError, match=r"^model\.name_or_path=local-user/no-such-model: no such model on .*typo"):
        resolve_hub_repo(
            "model.name_or_path", "local-user/no-such-model", None, repo_type="model", revision_key="model.revision"
        )
    with pytest.raises(ValueError, match=r"^data\.revision=v9: dataset local-user/wikitext on .* no such branch"):
        resolve_hub_repo("data.source", repo, "v9", repo_type="dataset", revision_key="data.revision")


def test_a_revision_of_a_local_source_is_refused(tiny_world):
    local = DataConfig(source=tiny_world["corpus"], revision="v1")
    with pytest.raises(ValueError, match=r"^data\.revision=v1 names a revision of a Hub dataset, but data\.source "):
        pin_hub_revisions(ModelConfig(), local, warn=pytest.fail)


def test_a_resume_on_another_commit_is_refused():
    saved = {
        "model": {"path": "model", "fingerprint": "aa"},
        "data": {"source": {"key": "data.source", "repo": "org/d", "commit": "1" * 40}, "fingerprint": "f1"},
    }
    same = {**saved, "data": {**saved["data"], "fingerprint": "f2"}, "versions": {"torch": "x"}}
    check_same_sources(saved, same, "ckpt")  # versions and the rows' settings may change
    moved = {**saved, "data": {"source": {"key": "data.source", "repo": "org/d", "commit": "2" * 40, "cached": "x"}}}
    with pytest.raises(SourcesChanged, match=f"data.source: org/d at commit {'1' * 40} → org/d at commit {'2' * 40}"):
        check_same_sources(saved, moved, "ckpt")


def test_the_model_card_names_what_the_model_was_trained_from(tiny_world, tmp_path):
    """The card's lineage: the base model's and each source's identity, the rows' fingerprint and
    the versions; a local model or data file by its name, never its path."""
    import shutil

    from neuron_parallel.hub import write_model_card
    from neuron_parallel.lineage import model_identity, run_lineage

    model_dir = shutil.copytree(tiny_world["model"], tmp_path / "out")
    hub_source = {"key": "data.source[0]", "repo": "org/data", "commit": "c" * 40, "cached": "offline"}
    local_source = {"key": "data.source[1]", "path": "corpus.jsonl", "fingerprint": "f" * 20}
    lineage = run_lineage(
        model_identity(tiny_world["model"], tiny_world["model"]),
        {"source_0": hub_source, "source_1": local_source, "fingerprint": "rows123"},
    )
    card = write_model_card(model_dir, repo_id=None, base_model="model", datasets=[], summary={}, lineage=lineage)
    text = card.read_text()
    section = text.split("## Lineage", 1)[1].split("\n## ", 1)[0]
    assert f"| base model | model (fingerprint {lineage['model']['fingerprint']}) |" in section
    assert f"| data.source[0] | org/data at commit {'c' * 40} |" in section  # how it was read is not identity
    assert f"| data.source[1] | corpus.jsonl (fingerprint {'f' * 20}) |" in section
    assert "| tokenized data | fingerprint rows123 |" in section and "torch " in section
    assert str(Path(tiny_world["model"]).parent) not in text and str(tmp_path) not in text


def test_the_model_card_metadata_pins_the_hub_commits(tiny_world, tmp_path):
    """The card's YAML gives the base model's and each Hub dataset's commit beside their names, so
    that a reader loads exactly what the model was trained from; local ones add nothing there."""
    import shutil

    from huggingface_hub import ModelCard

    from neuron_parallel.hub import write_model_card
    from neuron_parallel.lineage import run_lineage

    model_dir = shutil.copytree(tiny_world["model"], tmp_path / "out")
    data = {
        "source_0": {"key": "data.source[0]", "repo": "org/data", "commit": "c" * 40},
        "source_1": {"key": "data.source[1]", "path": "corpus.jsonl", "fingerprint": "f" * 20},
        "fingerprint": "rows123",
    }
    lineage = run_lineage({"repo": "org/base", "commit": "b" * 40}, data)
    sources = ["org/data", str(tmp_path / "corpus.jsonl")]
    card = ModelCard.load(
        write_model_card(model_dir, repo_id=None, base_model="org/base", datasets=sources, summary={}, lineage=lineage)
    )
    assert card.data.base_model == "org/base" and card.data.base_model_revision == "b" * 40
    assert card.data.datasets == ["org/data"] and card.data.dataset_revisions == {"org/data": "c" * 40}
    local = run_lineage({"path": "base", "fingerprint": "a" * 20}, {"fingerprint": "rows123"})
    card = ModelCard.load(
        write_model_card(model_dir, repo_id=None, base_model=str(tmp_path), datasets=[], summary={}, lineage=local)
    )
    assert card.data.base_model is None and "base_model_revision" not in card.data.to_dict()
    assert "dataset_revisions" not in card.data.to_dict()
