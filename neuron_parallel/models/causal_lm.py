"""Hugging Face decoder-only models (Llama, Qwen2, Qwen3, Mistral) as pipeline stages.

A stage holds a contiguous range of decoder layers, plus the embedding on the first stage and
the final norm and lm_head on the last. Parameter names stay the Hugging Face ones
(``model.layers.<i>.…`` with the original layer index), so the shards of every stage merge into
one Hugging Face state dict and load from one. Models are built on the meta device and
materialised only after they have been split and sharded.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..parallel.dtensor import local, local_view

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def load_config(model_dir: str | Path):
    """The model's ``PretrainedConfig``, refusing architectures the stage code does not know."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(model_dir))
    except (OSError, ValueError) as e:  # unreadable or not JSON, or no model_type
        raise ValueError(
            f"{model_dir}/config.json does not load as a model config ({str(e).splitlines()[0]}); "
            "save the model with save_pretrained, or fix the file"
        ) from None
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model type {config.model_type!r} in {model_dir} is not supported; "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return config


def build_meta_model(config) -> nn.Module:
    """The full Hugging Face causal LM on the meta device: shapes only, no memory."""
    from transformers import AutoModelForCausalLM

    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


class CausalLMStage(nn.Module):
    """Layers ``layer_ids`` of a Hugging Face causal LM, with its Hugging Face parameter names.

    ``forward`` takes token ids on the first stage and hidden states elsewhere, and returns
    logits on the last stage and hidden states elsewhere.

    Rotary positions cover the full sequence, ``0 .. seq_len - 1``, even where sequence
    parallelism hands a layer only part of it. ``seq_len`` is a forward argument; when it is not
    given (a pipeline stage other than the first receives only its activations from torch
    pipelining, never extra arguments) it follows from the input: token ids are whole sequences,
    and hidden states arriving between stages hold ``1 / sequence_shards`` of each sequence.
    ``sequence_shards`` is fixed when the stage is sharded (tp under sequence parallelism, set
    by :func:`neuron_parallel.parallel.tensor.apply_tensor_parallel`; 1 otherwise).

    Rows packed from several documents come with ``positions`` (batch, seq_len): position ids
    that restart at 0 where each document begins. Rotary positions follow them, and attention
    is causal within a document and never crosses into another (:func:`document_causal_mask`).
    A stage other than the last then returns ``(hidden, positions)``, so the positions travel
    with each pipeline microbatch to the next stage as its second input.
    """

    def __init__(self, full: nn.Module, layer_ids: range, *, first: bool, last: bool, recompute_every: int = 0):
        super().__init__()
        self.config = full.config
        self.model = nn.Module()
        self.model.embed_tokens = full.model.embed_tokens if first else None
        self.model.layers = nn.ModuleDict({str(i): full.model.layers[i] for i in layer_ids})
        self.model.norm = full.model.norm if last else None
        self.model.rotary_emb = full.model.rotary_emb
        self.lm_head = full.lm_head if last else None
        self.first, self.last = first, last
        self.recompute_every = recompute_every
        self.sequence_shards = 1

    def full_seq_len(self, x: torch.Tensor) -> int:
        """The whole sequence length of this stage's input ``x`` (ids or hidden states)."""
        return x.shape[1] if self.first else x.shape[1] * self.sequence_shards

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor | None = None, seq_len: int | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        h = self.model.embed_tokens(x) if self.first else x
        local_h = local(h)
        if positions is None:
            seq_len = seq_len or self.full_seq_len(x)
            position_ids, mask = torch.arange(seq_len, device=local_h.device).unsqueeze(0), None
        else:
            position_ids, mask = positions, document_causal_mask(positions)
        rope = self.model.rotary_emb(local_h, position_ids)
        for i, layer in enumerate(self.model.layers.values()):
            if self.training and self.recompute_every and i % self.recompute_every == 0:
                h = checkpoint(layer, h, mask, position_ids, None, False, rope, use_reentrant=False)
            else:
                h = layer(h, attention_mask=mask, position_ids=position_ids, position_embeddings=rope)
        if self.last:
            return self.lm_head(self.model.norm(h))
        return h if positions is None else (h, positions)


def document_causal_mask(positions: torch.Tensor) -> torch.Tensor:
    """The boolean attention mask ``(batch, 1, seq, seq)`` of rows packed from documents: query
    ``i`` sees key ``j`` when ``j <= i`` and both lie in the same document, a document starting
    wherever the position id is 0. An explicit mask for scaled-dot-product attention runs on
    every device (cpu, cuda, neuron); variable-length kernels do not."""
    doc = (positions == 0).cumsum(-1)
    seq = positions.shape[-1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=positions.device).tril()
    return ((doc.unsqueeze(-1) == doc.unsqueeze(-2)) & causal).unsqueeze(1)


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The SUM of next-token cross entropy over the positions with a label (``labels`` is
    ``IGNORE_INDEX`` = -100 elsewhere), in fp32. The caller divides by the number of labelled
    positions of the whole global batch (see ``neuron_parallel.train.LOSS_RULE``): a mean per
    micro-batch would weigh a token by how many others share its micro-batch."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), ignore_index=-100, reduction="sum")


def materialize(stage: CausalLMStage, device: torch.device) -> None:
    """Allocate the (possibly sharded) meta parameters on ``device``, keeping a tied embedding
    and lm_head one parameter (``to_empty`` allocates each module's tensors separately), and
    rebuild the rotary buffers, which are computed at construction."""
    tied = (
        stage.lm_head is not None
        and stage.model.embed_tokens is not None
        and (stage.lm_head.weight is stage.model.embed_tokens.weight)
    )
    stage.to_empty(device=device)
    if tied:
        stage.lm_head.weight = stage.model.embed_tokens.weight
    rotary = stage.model.rotary_emb
    stage.model.rotary_emb = type(rotary)(config=stage.config).to(device)


def load_weights(stage: nn.Module, source, *, tied: bool, skip=None) -> None:
    """Copy every parameter's local slice from ``source`` (``HFWeights`` or
    ``CheckpointTensors``), reading only the slice each rank holds; parameters whose name
    ``skip(name)`` accepts are left as they are."""
    with torch.no_grad():
        for name, param in stage.named_parameters():
            if skip is not None and skip(name):
                continue
            local, gshape, offsets = local_view(param)
            key = name
            if name == "lm_head.weight" and tied and name not in source:
                key = "model.embed_tokens.weight"
            if key not in source:
                raise ValueError(f"{getattr(source, 'root', source)} has no tensor {key}")
            local.copy_(source.read(key, offsets, list(local.shape), global_shape=gshape))
