"""Hugging Face decoder-only models (Llama, Qwen2, Qwen3, Mistral) as pipeline stages.

A stage holds a contiguous range of decoder layers, plus the embedding on the first stage and
the final norm and lm_head on the last. Parameter names stay the Hugging Face ones
(``model.layers.<i>.…`` with the original layer index), so the shards of every stage merge into
one Hugging Face state dict and load from one. Models are built on the meta device and
materialised only after they have been split and sharded.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from torch.utils.checkpoint import checkpoint

from ..parallel.context import (
    BlockedMask,
    ContextMask,
    ContextShard,
    allowed_block_mask,
    allowed_mask,
    blocked_attention,
    document_ids,
)
from ..parallel.dtensor import local, local_view
from ..planning.attention import LOSS_CHUNK_BYTES, loss_chunk_tokens

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


ATTENTION = "neuron_parallel"
"""The name under which :func:`attention` is registered with Hugging Face's ``AttentionInterface``
and set as the model config's ``_attn_implementation``."""


def build_meta_model(config) -> nn.Module:
    """The full Hugging Face causal LM on the meta device: shapes only, no memory. Its attention
    layers call :func:`attention`."""
    from transformers import AttentionInterface, AutoModelForCausalLM

    AttentionInterface.register(ATTENTION, attention)
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.config._attn_implementation = ATTENTION  # the config object every layer reads at forward
    return model


def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """Attention of one layer, as Hugging Face's attention interface calls it (query, key and
    value ``(batch, heads, seq, head_dim)``; returns ``(batch, seq, heads, head_dim)`` and no
    weights). A FlexAttention ``BlockMask`` (:func:`document_block_mask`) runs FlexAttention,
    with grouped K/V heads as they are (``enable_gqa``); anything else (no mask: the causal path;
    an explicit mask) runs Hugging Face's scaled-dot-product attention unchanged. Under context
    parallelism the mask is a :class:`~neuron_parallel.parallel.context.ContextMask`: the keys and
    values of every cp rank are gathered first, in global order, and the local queries attend to
    them under its mask: FlexAttention's block mask as above, or a
    :class:`~neuron_parallel.parallel.context.BlockedMask` through
    :func:`~neuron_parallel.parallel.context.blocked_attention` (a block of queries at a time)."""
    if isinstance(attention_mask, ContextMask):
        key, value = attention_mask.shard.gather(key), attention_mask.shard.gather(value)
        attention_mask = attention_mask.mask
    if isinstance(attention_mask, BlockedMask):
        out = blocked_attention(query, key, value, attention_mask, scale=scaling, dropout=dropout)
        return out.transpose(1, 2).contiguous(), None
    if isinstance(attention_mask, BlockMask):
        gqa = query.shape[1] != key.shape[1]
        out = _flex(query.device.type)(query, key, value, block_mask=attention_mask, scale=scaling, enable_gqa=gqa)
        return out.transpose(1, 2).contiguous(), None
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def _flex(device_type: str):
    """``flex_attention``, compiled on CUDA: compiling generates the fused kernel that skips the
    masked blocks and never builds the scores (inside a layer compiled by ``train.compile`` the
    layer's compilation does it); eager ``flex_attention`` computes the same values through the
    full score matrix (used on CPU only to check the block mask, forward only: torch has no
    FlexAttention backward on CPU)."""
    if device_type != "cuda" or torch.compiler.is_compiling():
        return flex_attention
    return _compiled_flex()


@functools.cache
def _compiled_flex():
    return torch.compile(flex_attention, dynamic=False)


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
    is causal within a document and never crosses into another, through the mask of
    :meth:`document_mask`: a FlexAttention block mask on CUDA (no S×S mask, masked blocks
    skipped), an explicit additive mask elsewhere. A stage other than the last then returns
    ``(hidden, positions)``, so the positions travel with each pipeline microbatch to the next
    stage as its second input. With ``mask_documents = False``, set by the engine on the host for
    a micro-batch whose rows all have their labels in their first document
    (:func:`neuron_parallel.batches.causal_rows`), the rows take the mask-free causal path
    instead, the positions still giving the rotary positions (and the pipeline its shapes).

    Under context parallelism (``context``, a :class:`~neuron_parallel.parallel.context.ContextShard`
    set by the engine; None otherwise) a stage sees ``S / cp`` positions of each row, always with
    their ``positions``, and ``documents``: the document number of every position of the whole
    rows (rows, S), its third input, handed on with the positions to the next stage. Attention
    then gathers every cp rank's keys and values and masks by global index (and by document unless
    ``mask_documents`` is False): :meth:`context_mask`.

    The last stage returns logits, or with ``return_logits = False`` the final norm's output,
    which :meth:`loss` turns into the loss a chunk of tokens at a time (the engine's way).
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
        self.return_logits = True
        self.mask_documents = True
        self.flex_attention: bool | None = None
        """Whether packed rows attend through FlexAttention; None: on CUDA only."""
        self.context: ContextShard | None = None
        """This rank's place on the cp axis under context parallelism (None: whole rows)."""
        self.loss_chunk_bytes = LOSS_CHUNK_BYTES

    def full_seq_len(self, x: torch.Tensor) -> int:
        """The whole sequence length of this stage's input ``x`` (ids or hidden states)."""
        return x.shape[1] if self.first else x.shape[1] * self.sequence_shards

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor | None = None,
        documents: torch.Tensor | None = None,
        seq_len: int | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        h = self.model.embed_tokens(x) if self.first else x
        local_h = local(h)
        if positions is None:
            seq_len = seq_len or self.full_seq_len(x)
            position_ids, mask = torch.arange(seq_len, device=local_h.device).unsqueeze(0), None
        elif self.context is not None:
            mask, position_ids = self.context_mask(positions, documents, local_h.dtype), positions
        else:
            mask = self.document_mask(positions, local_h.dtype) if self.mask_documents else None
            position_ids = positions
        rope = self.model.rotary_emb(local_h, position_ids)
        for i, layer in enumerate(self.model.layers.values()):
            if self.training and self.recompute_every and i % self.recompute_every == 0:
                h = checkpoint(layer, h, mask, position_ids, None, False, rope, use_reentrant=False)
            else:
                h = layer(h, attention_mask=mask, position_ids=position_ids, position_embeddings=rope)
        if self.last:
            h = self.model.norm(h)
            return self.lm_head(h) if self.return_logits else h
        if positions is None:
            return h
        return (h, positions) if documents is None else (h, positions, documents)

    def document_mask(self, positions: torch.Tensor, dtype: torch.dtype) -> BlockMask | torch.Tensor:
        """The mask of rows packed from documents, built once per forward for every layer: a
        FlexAttention block mask on CUDA (unless attention dropout is on in training:
        FlexAttention has none), else :func:`document_causal_mask` as an additive mask (0 where
        attention is allowed, -inf elsewhere) in the dtype attention computes in (the autocast
        dtype, else ``dtype``), which scaled-dot-product attention uses as it is. A boolean mask
        would be converted to that in every layer, and the CPU kernel keeps each layer's
        converted copy for backward."""
        if self._flex(positions.device):
            return document_block_mask(positions)
        allowed = document_causal_mask(positions)
        dtype = self._mask_dtype(positions.device, dtype)
        return torch.zeros(allowed.shape, dtype=dtype, device=positions.device).masked_fill_(~allowed, float("-inf"))

    def context_mask(self, positions: torch.Tensor, documents: torch.Tensor | None, dtype: torch.dtype) -> ContextMask:
        """Under context parallelism, the mask of this rank's queries (``positions``' shape) over
        the whole rows: causal by global index, within one document of ``documents`` unless
        ``mask_documents`` is False. A FlexAttention block mask where :meth:`document_mask` would
        take one, else the blocked path's (:class:`~neuron_parallel.parallel.context.BlockedMask`,
        built a block of queries at a time, additive in :meth:`document_mask`'s dtype)."""
        device = positions.device
        return self.context.mask(
            positions.shape[-1],
            documents if self.mask_documents else None,
            device=device,
            flex=self._flex(device),
            dtype=self._mask_dtype(device, dtype),
        )

    def _flex(self, device: torch.device) -> bool:
        """Whether masks are FlexAttention block masks: ``flex_attention``, or by default on CUDA
        unless attention dropout is on in training (FlexAttention has none)."""
        if self.flex_attention is not None:
            return self.flex_attention
        return device.type == "cuda" and not (self.training and self.config.attention_dropout)

    @staticmethod
    def _mask_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
        """The dtype attention computes in: the autocast dtype, else ``dtype``."""
        return torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else dtype

    def loss(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """:func:`causal_lm_loss` of this (last) stage's lm_head over ``hidden``, the final norm's
        output (``return_logits = False``): :func:`lm_head_loss` with ``loss_chunk_bytes``."""
        return lm_head_loss(self.lm_head, hidden, labels, chunk_bytes=self.loss_chunk_bytes)

    def token_logps(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """:func:`lm_head_token_logps` of this (last) stage's lm_head over ``hidden``."""
        return lm_head_token_logps(self.lm_head, hidden, labels, chunk_bytes=self.loss_chunk_bytes)


def document_causal_mask(positions: torch.Tensor) -> torch.Tensor:
    """The boolean attention mask ``(batch, 1, seq, seq)`` of rows packed from documents: query
    ``i`` sees key ``j`` when ``j <= i`` and both lie in the same document, a document starting
    wherever the position id is 0. An explicit mask for scaled-dot-product attention runs on
    every device (cpu, cuda, neuron); variable-length kernels do not, and torch-neuronx runs its
    NKI flash attention kernel only without a mask (AWS Neuron documentation, TorchNeuron).
    :func:`~neuron_parallel.parallel.context.allowed_mask` of every query of the row."""
    seq = positions.shape[-1]
    return allowed_mask(torch.arange(seq, device=positions.device), seq, document_ids(positions))


def document_block_mask(positions: torch.Tensor) -> BlockMask:
    """:func:`document_causal_mask` as a FlexAttention ``BlockMask``: per block of query and key
    positions, whether it is empty, full or partial, and the mask function for partial blocks,
    so attention skips the empty blocks and no S×S tensor exists (built compiled on CUDA):
    :func:`~neuron_parallel.parallel.context.allowed_block_mask` of every query of the row."""
    seq = positions.shape[-1]
    return allowed_block_mask(torch.arange(seq, device=positions.device), seq, document_ids(positions))


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The SUM of next-token cross entropy over the positions with a label (``labels`` is
    ``IGNORE_INDEX`` = -100 elsewhere), in fp32. The caller divides by the number of labelled
    positions of the whole global batch (see ``neuron_parallel.train.LOSS_RULE``): a mean per
    micro-batch would weigh a token by how many others share its micro-batch."""
    return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), ignore_index=-100, reduction="sum")


def lm_head_loss(
    head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor, *, chunk_bytes: int = LOSS_CHUNK_BYTES
) -> torch.Tensor:
    """:func:`causal_lm_loss` of ``head(hidden)``, never holding the fp32 logits of more than
    :func:`~neuron_parallel.planning.attention.loss_chunk_tokens` tokens: the tokens are taken a
    chunk at a time, each chunk's logits and loss computed under activation checkpointing
    (``torch.utils.checkpoint``), so only the chunk's slice of ``hidden`` is kept for backward,
    where the chunk's logits are computed again (one more lm_head forward). A micro-batch of one
    chunk or fewer tokens runs as one piece, without recomputation. The sum over chunks is the
    same loss and the same gradients, up to the order of fp32 sums (under autocast the lm_head's
    weight gradient adds one bf16 product per chunk).

    Under tensor parallelism ``head`` is column-parallel with vocabulary-sharded logits, and the
    caller runs forward and backward inside ``loss_parallel()`` as for :func:`causal_lm_loss`;
    ``hidden`` (sequence-sharded under sequence parallelism) is gathered once, as the head's
    own input hook would, before it is cut into chunks."""
    n = labels.numel()
    chunk = loss_chunk_tokens(local(head.weight).shape[0], chunk_bytes)
    if n <= chunk:
        return causal_lm_loss(head(hidden), labels)
    if isinstance(hidden, DTensor):
        hidden = hidden.redistribute(placements=[Replicate()] * hidden.device_mesh.ndim)
    hidden, labels = hidden.flatten(0, -2), labels.flatten()
    grad = torch.is_grad_enabled()
    total = None
    for start in range(0, n, chunk):
        piece = (head, hidden[start : start + chunk], labels[start : start + chunk])
        part = checkpoint(_logits_loss, *piece, use_reentrant=False) if grad else _logits_loss(*piece)
        total = part if total is None else total + part
    return total


def _logits_loss(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return causal_lm_loss(head(hidden), labels)


def lm_head_token_logps(
    head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor, *, chunk_bytes: int = LOSS_CHUNK_BYTES
) -> torch.Tensor:
    """The log-probability of each position's label under ``head(hidden)``, ``labels``' shape, fp32,
    0 where there is no label: the per-token terms of :func:`causal_lm_loss` (negated), computed a
    chunk of tokens at a time as :func:`lm_head_loss` does (the same chunking, checkpointing and
    loss-parallel rules). A whole tensor on every rank of a tensor-parallel group."""
    n = labels.numel()
    chunk = loss_chunk_tokens(local(head.weight).shape[0], chunk_bytes)
    if n <= chunk:
        return _token_logps(head, hidden, labels).view(labels.shape)
    if isinstance(hidden, DTensor):
        hidden = hidden.redistribute(placements=[Replicate()] * hidden.device_mesh.ndim)
    flat_hidden, flat_labels = hidden.flatten(0, -2), labels.flatten()
    grad = torch.is_grad_enabled()
    parts = []
    for start in range(0, n, chunk):
        piece = (head, flat_hidden[start : start + chunk], flat_labels[start : start + chunk])
        parts.append(checkpoint(_token_logps, *piece, use_reentrant=False) if grad else _token_logps(*piece))
    return torch.cat(parts).view(labels.shape)


def _token_logps(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = head(hidden)
    nll = F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), ignore_index=-100, reduction="none")
    nll = nll.full_tensor() if isinstance(nll, DTensor) else nll
    return -nll


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
