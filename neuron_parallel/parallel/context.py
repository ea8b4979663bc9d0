"""Context parallelism (cp): every row's sequence split over the ``cp`` ranks of the cp mesh
axis, with attention across the shards exact.

Sharding, on the host (the batch's host tensors, the indices from numpy). A row of
``S = data.block_size`` positions is cut into ``2·cp`` chunks of ``S / (2·cp)``; cp rank ``r``
holds chunk ``r`` then chunk ``2·cp − 1 − r``, ``S / cp`` positions (:func:`shard_index`). Under
a causal mask a query's work grows with its index, so pairing an early chunk with a late one
gives every rank the same attention work (the load-balanced sharding of Megatron-LM's context
parallelism and of torchtitan). Inputs, labels, position ids and sequence ids (preference rows)
are cut with the same index (:func:`shard_batch`). The document of every position is numbered
from the whole row's position ids before the row is cut (a document starts where the position
id is 0, as ``neuron_parallel.models.causal_lm.document_causal_mask`` reads them), so a document
may cross any shard boundary. A stream row (no position ids) gets positions ``0 .. S−1``.

Attention, on the device. Each layer all-gathers its keys and values over the cp group, with
the grouped K/V heads as they are (before any repeat for the query heads), and puts them back in
global order (:meth:`ContextShard.gather`); the local queries then attend under
:func:`allowed_mask`: key ``j`` is seen by query ``i`` when ``j <= i`` by global index and both
lie in one document (only the first for rows that need no document mask, ``batch.causal``: the
local queries are not a prefix of the row, so the mask-free causal kernel does not apply). On
CUDA the kernel is FlexAttention with a block mask of ``S/cp × S`` (:func:`allowed_block_mask`):
masked blocks skipped, no score matrix. Every other device (neuron; CPU) has no block-sparse
kernel: torch-neuronx runs its NKI flash-attention kernel only without a mask (AWS Neuron
documentation, TorchNeuron), and with one it decomposes scaled-dot-product attention into fp32
scores and softmax. There :func:`blocked_attention` takes the local queries
``CONTEXT_QUERY_BLOCK`` at a time (``neuron_parallel.utils``): for each block it builds that
block's rows of the additive mask (never the whole ``S/cp × S``), repeats the K/V heads for the
query heads and runs scaled-dot-product attention against the gathered K/V, inside
``torch.utils.checkpoint``, so that backward recomputes the block instead of keeping its scores;
the values are those of the whole mask, a query's softmax still spanning the whole row. The
gather is ``all_gather_single`` of ``torch.distributed._functional_collectives``, which has
autograd: backward reduce-scatters the K/V gradients (sums them over the cp ranks whose queries
used them, and hands each rank its own shard's).

Why an all-gather of K/V and not a ring (ring attention passes K/V blocks from rank to rank and
merges partial softmax results): as the Llama 3 report (Dubey et al. 2024, section 3.3.2)
argues, the all-gather takes any mask (here the document mask across shard boundaries) with the
existing kernels unchanged, and with grouped-query attention the K/V are small beside the
queries, so the gather's cost is small. What it costs, per layer and per rank (b rows, kv local
KV heads, head_dim d, e bytes per element of the compute dtype):

* memory: the gathered K and V of the whole row, ``2·b·S·kv·d·e`` (a ring holds two blocks of
  ``S/cp``), kept for backward (recomputed under activation checkpointing). FlexAttention's
  block indices are built once per forward for every layer. On the blocked path everything else
  exists for one block of ``B`` queries at a time, in forward and again in backward: the block's
  scores and probabilities, ``b·heads·B·S·4`` bytes each where the softmax runs in fp32
  (neuron's decomposition; the probabilities kept for the block's backward now live from its
  recompute to its gradient), the block's mask ``b·B·S·e``, and the K/V heads repeated for the
  query heads, ``2·b·S·heads·d·e`` (at most half the scores where ``d·e ≤ B``, e.g. ``d ≤ 128``
  in bf16 at ``B = 512``). Nothing grows with ``S/cp × S``; the price is time: backward runs the
  attention's forward once more per layer (the scores, not the projections).
* bytes: forward, each rank receives ``(cp−1)/cp · 2·b·S·kv·d·e`` (the all-gather of K and of V);
  backward, as many in the reduce-scatter of their gradients. A ring moves as many bytes, in
  ``cp−1`` steps it overlaps with the blocks' attention; the all-gather is not overlapped.

Loss and gradients: each cp rank's loss is the sum over its own positions, normalised by the
labelled positions of the whole global batch; the gradients of every replicated parameter are
summed over the dp × cp group by the gradient reduction (``neuron_parallel.engine``), which makes
them the gradient of the global mean. Preference objectives sum each completion's log-probabilities over
the cp shards first (:meth:`ContextShard.sum`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed._functional_collectives import all_gather_single
from torch.nn.attention.flex_attention import BlockMask, create_block_mask
from torch.utils.checkpoint import checkpoint

from ..utils import CONTEXT_QUERY_BLOCK, check_context_split


def chunk_order(cp: int, cp_rank: int) -> tuple[int, int]:
    """The two chunks of a row (of ``2·cp``) that cp rank ``cp_rank`` holds, in its order."""
    return cp_rank, 2 * cp - 1 - cp_rank


def shard_index(seq: int, cp: int, cp_rank: int) -> np.ndarray:
    """The global positions of a row of ``seq`` that cp rank ``cp_rank`` holds, in local order.
    Raises ValueError naming ``data.block_size`` when ``seq`` does not cut into 2·cp chunks."""
    check_context_split(seq, cp)
    chunk = seq // (2 * cp)
    return np.concatenate([np.arange(c * chunk, (c + 1) * chunk) for c in chunk_order(cp, cp_rank)])


def document_ids(positions: torch.Tensor) -> torch.Tensor:
    """The document number of every position of rows of ``positions`` (rows, seq): a document
    starts where the position id is 0 (``document_causal_mask``'s rule)."""
    return (positions == 0).cumsum(-1)


def shard_batch(batch, cp: int, cp_rank: int):
    """This cp rank's part of ``batch`` (a :class:`neuron_parallel.batches.Batch` of host
    tensors): inputs, labels, positions and sequence ids of the positions of :func:`shard_index`,
    with ``documents`` (every position's document over the whole rows) and the rows' ``causal``
    verdict found on the whole rows. On the host, without reading any tensor into Python."""
    rows, seq = batch.inputs.shape
    index = torch.from_numpy(shard_index(seq, cp, cp_rank))
    if batch.positions is None:  # a stream: one document, the causal path
        positions, causal = torch.arange(seq).expand(rows, seq), (True,) * rows
    else:
        positions, causal = batch.positions, batch.causal_rows

    def cut(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.index_select(1, index)

    return dataclasses.replace(
        batch,
        inputs=cut(batch.inputs),
        labels=cut(batch.labels),
        positions=cut(positions),
        targets=None,  # counted from the rank's labels, if ever asked
        causal_rows=causal,
        sequence_ids=cut(batch.sequence_ids),
        documents=document_ids(positions),
    )


def allowed_mask(query_index: torch.Tensor, seq: int, documents: torch.Tensor | None) -> torch.Tensor:
    """The boolean mask ``(rows or 1, 1, len(query_index), seq)`` of queries at global positions
    ``query_index`` over the keys of the whole row in global order: causal by global index, and
    within one document when ``documents`` (rows, seq) is given."""
    keys = torch.arange(seq, device=query_index.device)
    causal = keys.unsqueeze(0) <= query_index.unsqueeze(1)
    if documents is None:
        return causal[None, None]
    same = documents[:, query_index].unsqueeze(-1) == documents.unsqueeze(-2)
    return (same & causal).unsqueeze(1)


def allowed_block_mask(query_index: torch.Tensor, seq: int, documents: torch.Tensor | None) -> BlockMask:
    """:func:`allowed_mask` as a FlexAttention ``BlockMask`` (query length ``len(query_index)``,
    key length ``seq``): empty blocks skipped, no ``S/cp × S`` tensor (built compiled on CUDA)."""
    device = query_index.device
    if documents is None:

        def causal(b, h, q, kv):
            return kv <= query_index[q]

        fn, rows = causal, None
    else:
        query_docs = documents[:, query_index]

        def same_document_causal(b, h, q, kv):
            return (kv <= query_index[q]) & (query_docs[b, q] == documents[b, kv])

        fn, rows = same_document_causal, documents.shape[0]
    cuda = device.type == "cuda"
    return create_block_mask(fn, rows, None, len(query_index), seq, device=device, _compile=cuda)


@dataclass(frozen=True, eq=False)
class BlockedMask:
    """:func:`allowed_mask` of the local queries over the whole row, for :func:`blocked_attention`:
    never built whole, only a block of queries' rows at a time (:meth:`rows`)."""

    query_index: torch.Tensor
    """The global positions of the local queries, on the device."""
    seq: int
    """The whole row's length ``S``: the keys."""
    documents: torch.Tensor | None
    """Every position's document over the whole rows (rows, S); None for rows that need no
    document mask."""
    dtype: torch.dtype
    """The dtype attention computes in, the additive mask's."""

    def rows(self, start: int, stop: int) -> torch.Tensor:
        """The additive mask ``(rows or 1, 1, stop − start, S)`` of local queries ``start`` to
        ``stop``: 0 where :func:`allowed_mask` allows attention, -inf elsewhere (every query sees
        itself, so no row is all -inf)."""
        allowed = allowed_mask(self.query_index[start:stop], self.seq, self.documents)
        additive = torch.full(allowed.shape, float("-inf"), dtype=self.dtype, device=allowed.device)
        return additive.masked_fill_(allowed, 0.0)


def blocked_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: BlockedMask,
    *,
    scale: float | None = None,
    dropout: float = 0.0,
    block: int = CONTEXT_QUERY_BLOCK,
) -> torch.Tensor:
    """Attention of the local queries ``query`` (rows, heads, S/cp, d) over the gathered ``key``
    and ``value`` (rows, kv heads, S, d, global order) under ``mask``, ``block`` queries at a
    time; ``(rows, heads, S/cp, d)``, the values of one scaled-dot-product attention under the
    whole mask. Each block (:func:`_attend_block`) runs under ``torch.utils.checkpoint``
    (non-reentrant): forward keeps only its inputs (a view of ``query``; ``key`` and ``value``,
    held once for all blocks), and backward recomputes the block's mask and scores just before its
    gradient, so that one block's mask and scores exist at a time. The RNG state is kept for the
    recompute only where there is dropout to replay."""
    outs = [
        checkpoint(
            _attend_block,
            query[:, :, start : start + block],
            key,
            value,
            mask,
            start,
            scale,
            dropout,
            use_reentrant=False,
            preserve_rng_state=dropout > 0,
        )
        for start in range(0, query.shape[2], block)
    ]
    return torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]


def _attend_block(query, key, value, mask: BlockedMask, start: int, scale, dropout: float) -> torch.Tensor:
    """One block of :func:`blocked_attention`: its rows of the mask, the K/V heads repeated for
    the query heads (query head ``h`` reads K/V head ``h // (heads / kv)``, Hugging Face's
    ``repeat_kv``), and scaled-dot-product attention. The repeat is explicit, not SDPA's
    ``enable_gqa``, as Hugging Face's SDPA path does with a mask: torch-neuronx does not document
    ``enable_gqa``, and torch's math decomposition (neuron's path) repeats the heads itself
    anyway. Only CPU's fused kernel would take the grouped heads without a copy; one path for
    every device is worth that copy, which lives within the block."""
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    rows = mask.rows(start, start + query.shape[2])
    return F.scaled_dot_product_attention(query, key, value, attn_mask=rows, dropout_p=dropout, scale=scale)


def to_global_order(shards: list[torch.Tensor] | tuple[torch.Tensor, ...], dim: int) -> torch.Tensor:
    """The whole sequence from the ``cp`` ranks' shards (rank order, each chunk ``r`` then chunk
    ``2·cp − 1 − r`` along ``dim``), in global order: one copy."""
    cp = len(shards)
    half = shards[0].shape[dim] // 2
    first = [s.narrow(dim, 0, half) for s in shards]
    second = [s.narrow(dim, half, half) for s in reversed(shards)]
    return torch.cat(first + second, dim=dim) if cp > 1 else shards[0]


class _SumOverContext(torch.autograd.Function):
    """Forward: the sum over the cp group (an all-reduce). Backward: the identity. Every cp rank
    goes on to compute the same loss from the sum (a replicated loss, counted once), so rank
    ``r``'s share of the gradient is ``ℓ'(Σ) · ∂x_r``, and the cp sum of gradients adds the shares
    up to ``ℓ'(Σ) · ∂Σ``. (``torch.distributed.nn.functional.all_reduce`` also all-reduces in
    backward, which would count the replicated loss cp times.)"""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


@dataclass(eq=False)
class ContextShard:
    """One rank's place on the cp axis: its rank, the group, and the device-side pieces of the
    attention across shards. Set on every stage as ``CausalLMStage.context`` (None without cp)."""

    cp: int
    cp_rank: int
    group: dist.ProcessGroup | None = None
    _indices: dict = field(default_factory=dict, repr=False)

    def shard_batch(self, batch):
        """:func:`shard_batch` for this rank."""
        return shard_batch(batch, self.cp, self.cp_rank)

    def query_index(self, local_len: int, device: torch.device) -> torch.Tensor:
        """The global positions of this rank's ``local_len`` queries, on ``device`` (made once)."""
        key = (local_len, device)
        index = self._indices.get(key)
        if index is None:
            index = torch.from_numpy(shard_index(local_len * self.cp, self.cp, self.cp_rank)).to(device)
            self._indices[key] = index
        return index

    def mask(
        self, local_len: int, documents: torch.Tensor | None, *, device: torch.device, flex: bool, dtype: torch.dtype
    ) -> ContextMask:
        """The attention mask of this rank's ``local_len`` queries over the whole row, for every
        layer of a forward: a ``BlockMask`` with ``flex``, else a :class:`BlockedMask` whose
        blocks are additive in ``dtype``. ``documents``: None for rows that need no document
        mask."""
        index = self.query_index(local_len, device)
        seq = local_len * self.cp
        if flex:
            return ContextMask(allowed_block_mask(index, seq, documents), self)
        return ContextMask(BlockedMask(index, seq, documents, dtype), self)

    def gather(self, t: torch.Tensor, dim: int = 2) -> torch.Tensor:
        """``t`` (this rank's shard along ``dim``, the sequence dim of ``(rows, heads, seq, d)``)
        of every cp rank, in global order: an all-gather over the cp group whose backward
        reduce-scatters the gradient."""
        gathered = all_gather_single(t.contiguous(), 0, self.group)
        return to_global_order(gathered.view(self.cp, *t.shape).unbind(0), dim)

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over the cp group, the gradient passed through (:class:`_SumOverContext`)."""
        return _SumOverContext.apply(t, self.group)


@dataclass(frozen=True, eq=False)
class ContextMask:
    """What a layer's attention gets as its mask under cp: the mask of the local queries over
    the whole row (a FlexAttention ``BlockMask``, or a :class:`BlockedMask` for
    :func:`blocked_attention`) and the shard that gathers the keys and values
    (``neuron_parallel.models.causal_lm.attention``)."""

    mask: BlockMask | BlockedMask
    shard: ContextShard
