"""Checks of the machine, the model's files and the Hub that the pipeline's preflight step
makes before it reads any data or starts any rank, so that a run which cannot work fails in
seconds, with a message naming the problem and the fix, rather than after tokenization or
inside torchrun:

- ``check_device``: the machine has the device (and as many of them) as the launch names;
- ``check_model_dir``: the model directory's weights cover every parameter its config.json
  builds, in the right shape, and its tokenizer's ids fit the embedding;
- ``check_hub``: the Hub endpoint a run will upload to answers, and accepts the token.

Each raises ``ValueError``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from .config import LaunchConfig

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
    missing or of another shape) or whose tokenizer has more ids than the embedding has rows."""
    from .checkpoint.tensors import HFWeights
    from .models.causal_lm import build_meta_model, load_config

    config = load_config(model_dir)
    weights = HFWeights(model_dir)
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
