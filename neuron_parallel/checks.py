"""Checks of the machine, the model's files and the Hub that the pipeline's preflight step
makes before it reads any data or starts any rank, so that a run which cannot work fails in
seconds, with a message naming the problem and the fix, rather than after tokenization or
inside torchrun:

- ``check_device``: the machine has the device (and as many of them) as the launch names;
- ``check_model_dir``: the model directory's weights cover every parameter its config.json
  builds, in the right shape, and its tokenizer's ids fit the embedding;
- ``check_hub``: the Hub endpoint a run will upload to answers, and accepts the token;
- ``resolve_hub_repo``: a Hub model or dataset named by the config resolves to a commit, on the Hub
  or, offline (``HF_HUB_OFFLINE=1``) or with the Hub unreachable, in the Hugging Face cache
  (``pin_hub_revisions`` does it for a run's model and data).

Each raises ``ValueError``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .config import DataConfig, LaunchConfig, ModelConfig
from .utils import names_local_path

MAX_LISTED = 5
"""Problems of one kind named in a message; the rest are counted."""


def _listed(items: list[str]) -> str:
    more = len(items) - MAX_LISTED
    return ", ".join(items[:MAX_LISTED]) + (f" and {more} more" if more > 0 else "")


def check_device(launch: LaunchConfig) -> None:
    """Refuse a launch whose device this machine lacks. The neuron device is not touched (it
    must not be before the ranks' ``init_process_group``): its runtime package must be present."""
    if launch.device == "cuda":
        import torch

        found = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if found == 0:
            raise ValueError(
                "launch.device=cuda but this machine has no CUDA device (torch.cuda.is_available() is False); "
                "set launch.device=cpu, or run on a GPU machine with a CUDA build of torch"
            )
        if found < launch.nproc_per_node:
            raise ValueError(
                f"launch.nproc_per_node={launch.nproc_per_node} but this machine has {found} CUDA devices; "
                f"set launch.nproc_per_node to at most {found}"
            )
    elif launch.device == "neuron" and importlib.util.find_spec("torch_neuronx") is None:
        raise ValueError(
            "launch.device=neuron but torch-neuronx (TorchNeuron) is not installed here; run on a Trainium "
            "host with the Neuron SDK's torch-neuronx, or set launch.device=cpu"
        )


def check_model_dir(model_dir: str | Path) -> None:
    """Refuse a model directory whose weights do not build its config's model (a tensor
    missing or of another shape), whose config or tokenizer files (copied into checkpoints) link
    out of it, or whose tokenizer has more ids than the embedding has rows."""
    from .checkpoint.format import user_model_files
    from .checkpoint.tensors import HFWeights
    from .models.causal_lm import build_meta_model, load_config

    config = load_config(model_dir)
    weights = HFWeights(model_dir)
    user_model_files(model_dir)  # what checkpoints copy: a link leading out of the folder is refused now
    missing, wrong = [], []
    for name, param in build_meta_model(config).named_parameters():  # a tied lm_head is listed once
        if name not in weights:
            missing.append(name)
        elif (stored := weights.shape_dtype(name)[0]) != list(param.shape):
            wrong.append(f"{name} {stored} (config: {list(param.shape)})")
    if missing:
        raise ValueError(
            f"{model_dir}: {len(missing)} weights of the model its config.json describes are missing: "
            f"{_listed(missing)}; the weights are incomplete or belong to another config: save the model again "
            "with save_pretrained, or fix config.json"
        )
    if wrong:
        raise ValueError(
            f"{model_dir}: {len(wrong)} weights have another shape than config.json gives: {_listed(wrong)}; "
            "the weights belong to another config: fix config.json or save the model again"
        )
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    except (OSError, ValueError) as e:
        raise ValueError(
            f"{model_dir}: its tokenizer does not load ({str(e).splitlines()[0]}); save it with the model "
            "(tokenizer.save_pretrained)"
        ) from None
    if len(tokenizer) > config.vocab_size:
        raise ValueError(
            f"{model_dir}: the tokenizer has {len(tokenizer)} tokens but the model's vocab_size is "
            f"{config.vocab_size}, so ids from {config.vocab_size} up would index past the embedding; resize the "
            f"embeddings (model.resize_token_embeddings({len(tokenizer)})) and save the model, or use the "
            "model's own tokenizer"
        )


def check_hub(endpoint: str | None, repo_id: str, token: str | None) -> None:
    """Refuse an upload target that cannot work: an endpoint that does not answer, or one that
    refuses the token (or no token at all). Nothing is created or changed on the Hub."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import HfHubHTTPError, LocalTokenNotFoundError

    url = (endpoint or constants.ENDPOINT).rstrip("/")
    fix = (
        "set HF_TOKEN (or hub.token_secret, a Prefect Secret block) to a token with write access, or unset "
        "hub.repo_id to skip the upload"
    )
    try:
        HfApi(endpoint=url, token=token).whoami()
    except LocalTokenNotFoundError:
        raise ValueError(f"hub.repo_id={repo_id} is set but there is no Hub token; {fix}") from None
    except HfHubHTTPError as e:
        status = getattr(e.response, "status_code", None)
        if status in (401, 403):
            raise ValueError(f"{url} refused the Hub token ({status}) for hub.repo_id={repo_id}; {fix}") from None
        # Any other answer (a Hub without whoami, a proxy's error page) still shows the host is up.
    except Exception as e:  # refused, DNS, TLS, timeout: the upload after training would fail the same way
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(
            f"hub.endpoint {url} cannot be reached ({reason}); check the URL and this machine's network, or unset "
            "hub.repo_id to skip the upload"
        ) from None


HUB_TIMEOUT_S = 10.0
"""How long the preflight waits for the Hub's answer about one repo."""


@dataclass(frozen=True, slots=True)
class HubRevision:
    """A Hub repo resolved to the commit a run reads."""

    repo_id: str
    repo_type: str
    """model or dataset."""
    commit: str
    cached: str | None = None
    """Why the commit was taken from the local Hugging Face cache rather than from the Hub (offline
    mode, the Hub unreachable), or None when the Hub answered."""

    def describe(self) -> str:
        """A line saying where the commit came from."""
        where = f"the local Hugging Face cache ({self.cached})" if self.cached else "the Hub"
        return f"{self.repo_type} {self.repo_id} at commit {self.commit}, from {where}"


def hub_name(source: str | list[str]) -> str | None:
    """``source`` when it names a Hub repo (``name`` or ``org/name``, nothing on disk there), else None."""
    if not isinstance(source, str) or Path(source).expanduser().exists() or names_local_path(source):
        return None
    return source


def cached_commit(repo_id: str, repo_type: str, revision: str | None) -> str | None:
    """The commit of ``repo_id`` at ``revision`` that the Hugging Face cache holds a snapshot of:
    the commit itself, the commit the cache last saw ``revision`` (a branch or tag) at, or with no
    revision ``main``'s, else the newest snapshot; None when it holds none. The datasets cache
    (``datasets``' prepared copies, which it keys by name alone) is never consulted."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import REGEX_COMMIT_HASH, repo_folder_name

    folder = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo_id, repo_type=repo_type)
    snapshots = folder / "snapshots"
    if revision is not None and REGEX_COMMIT_HASH.fullmatch(revision):
        return revision if (snapshots / revision).is_dir() else None
    ref = folder / "refs" / (revision or "main")
    if ref.is_file() and (snapshots / (sha := ref.read_text().strip())).is_dir():
        return sha
    if revision is None and snapshots.is_dir():
        newest = max(snapshots.iterdir(), key=lambda p: p.stat().st_mtime, default=None)
        return newest.name if newest is not None else None
    return None


def _datasets_cache_copy(repo_id: str) -> Path | None:
    """A copy ``datasets`` prepared under the same name (from a local folder as likely as from the
    Hub), which ``load_dataset`` would fall back to."""
    from huggingface_hub import constants

    root = Path(os.environ.get("HF_DATASETS_CACHE") or Path(constants.HF_HOME) / "datasets")
    path = root / repo_id.replace("/", "___")
    return path if path.is_dir() else None


def hub_refusal(key: str, repo_id: str, repo_type: str, revision: str | None, reason: str) -> ValueError:
    """The refusal of a Hub name that is not available here: ``reason`` and every fix."""
    what = "model" if repo_type == "model" else "dataset"
    at = f" at revision {revision}" if revision else ""
    local = "a local model directory" if repo_type == "model" else "local data files or a dataset folder"
    stale = _datasets_cache_copy(repo_id) if repo_type == "dataset" else None
    note = f" ({stale} holds a dataset of that name but not this Hub repo's files, so it is not used)" if stale else ""
    return ValueError(
        f"{key}={repo_id}: {reason}, and the Hugging Face cache holds no complete copy of this {what}{at}{note}; "
        "run where the Hub can be reached (with HF_TOKEN set to a token that can read it, if it is gated or "
        f"private), or set HF_HUB_OFFLINE=1 with a cache that holds it, or point {key} at {local}"
    )


def resolve_hub_repo(key: str, repo_id: str, revision: str | None, *, repo_type: str, revision_key: str) -> HubRevision:
    """The commit ``repo_id`` (a ``repo_type`` repo named by config key ``key``) is at for
    ``revision`` (config key ``revision_key``; None: the newest). Asked of the Hub
    (``HF_ENDPOINT``, token ``HF_TOKEN`` as huggingface_hub reads them) unless ``HF_HUB_OFFLINE=1``;
    offline, or when the Hub cannot be reached, the Hugging Face cache's snapshot of that repo at
    that revision (:func:`cached_commit`), with ``cached`` saying why. A repo that does not exist
    (or is private), a gated one without access, an unknown revision, or one neither the Hub nor
    the cache has is refused with a ``ValueError`` naming the key, the id and the fix."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    url = constants.ENDPOINT.rstrip("/")
    if constants.is_offline_mode():
        reason = "offline (HF_HUB_OFFLINE=1)"
    else:
        try:
            sha = HfApi().repo_info(repo_id, repo_type=repo_type, revision=revision, timeout=HUB_TIMEOUT_S).sha
            return HubRevision(repo_id, repo_type, sha)
        except HFValidationError as e:
            raise ValueError(
                f"{key}={repo_id!r} is neither an existing local path nor a Hub repo id ({str(e).splitlines()[0]}); "
                "fix the path or write the id as name or org/name"
            ) from None
        except GatedRepoError:
            raise ValueError(
                f"{key}={repo_id}: the {repo_type} is gated on {url} and this machine has no access; accept its "
                "conditions on its Hub page and set HF_TOKEN to a token of that account, or point "
                f"{key} at a local copy"
            ) from None
        except RevisionNotFoundError:
            raise ValueError(
                f"{revision_key}={revision}: {repo_type} {repo_id} on {url} has no such branch, tag or commit; fix "
                f"{revision_key}, or unset it for the newest commit"
            ) from None
        except RepositoryNotFoundError:
            raise ValueError(
                f"{key}={repo_id}: no such {repo_type} on {url}, or it is private; check the id for a typo, set "
                f"HF_TOKEN to a token that can read it if it is private, or point {key} at a local path"
            ) from None
        except HfHubHTTPError as e:
            status = getattr(e.response, "status_code", None)
            if status in (401, 403):
                raise ValueError(
                    f"{key}={repo_id}: {url} refused the Hub token ({status}); set HF_TOKEN to a valid token that can "
                    f"read it, or unset it for a public {repo_type}"
                ) from None
            reason = f"the Hub at {url} answered {status}"  # a Hub that is down: the cache may still serve it
        except Exception as e:  # refused, DNS, TLS, timeout
            reason = f"the Hub at {url} cannot be reached ({str(e).splitlines()[0] if str(e) else type(e).__name__})"
    sha = cached_commit(repo_id, repo_type, revision)
    if sha is None:
        raise hub_refusal(key, repo_id, repo_type, revision, reason)
    return HubRevision(repo_id, repo_type, sha, cached=reason)


def hub_sources(data: DataConfig) -> list[tuple[str, str, str | None, str]]:
    """Every Hub dataset the data section reads: ``(key, repo id, revision asked, revision key)``,
    training sources first, then an evaluation source that is not one of them. A revision given
    for a local source only (nothing to apply it to) is refused."""
    if data.weights is not None:
        entries = [
            (f"data.source[{i}]", s, data.revision_of(i), f"data.revision[{i}]") for i, s in enumerate(data.source)
        ]
    else:
        entries = [("data.source", data.source, data.revision_of(), "data.revision")]
    found = [(key, name, rev, rkey) for key, s, rev, rkey in entries if (name := hub_name(s)) is not None]
    named = [(key, s, rev, rkey) for key, s, rev, rkey in entries if rev is not None and hub_name(s) is None]
    if named and (isinstance(data.revision, list) or not found):
        key, source, rev, rkey = named[0]
        raise ValueError(
            f"{rkey}={rev} names a revision of a Hub dataset, but {key} {source!r} is local (identified by its "
            f"contents); remove {rkey}{' (null for a local entry)' if isinstance(data.revision, list) else ''}"
        )
    eval_name = hub_name(data.eval_source) if data.eval_source is not None else None
    if eval_name is not None and eval_name not in {name for _, name, _, _ in found}:
        found.append(("data.eval_source", eval_name, None, "data.revision"))
    return found


def pin_hub_revisions(
    model: ModelConfig, data: DataConfig, *, warn: Callable[[str], None]
) -> tuple[ModelConfig, DataConfig]:
    """``model`` and ``data`` with the revision of every Hub name in them replaced by the commit it
    resolves to now (:func:`resolve_hub_repo`), so that every later step reads exactly that commit;
    local paths stay as they are. A commit taken from the local cache is said in ``warn``."""
    pinned: dict[str, str] = {}
    name = hub_name(model.name_or_path)
    if name is not None:
        rev = resolve_hub_repo(
            "model.name_or_path", name, model.revision, repo_type="model", revision_key="model.revision"
        )
        pinned["model"] = rev.commit
        if rev.cached:
            warn(f"preflight: model.name_or_path: using the {rev.describe()}")
    for key, repo_id, revision, revision_key in hub_sources(data):
        rev = resolve_hub_repo(key, repo_id, revision, repo_type="dataset", revision_key=revision_key)
        pinned[key] = rev.commit
        if rev.cached:
            warn(f"preflight: {key}: using the {rev.describe()}")
    if "model" in pinned:
        model = dataclasses.replace(model, revision=pinned["model"])
    if data.weights is not None:
        revisions = [pinned.get(f"data.source[{i}]") for i in range(len(data.source))]  # None: a local one
        data = dataclasses.replace(data, revision=revisions if any(revisions) else None)
    elif "data.source" in pinned:
        data = dataclasses.replace(data, revision=pinned["data.source"])
    return model, data
