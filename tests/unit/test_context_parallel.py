"""Context parallelism's host-side sharding and its attention, in one process: each cp rank holds
chunks r and 2·cp−1−r of a row, the shards put back in global order give the row, and the
local queries attending to the gathered keys and values under the shard's mask (the blocked
path, a block of queries at a time, or FlexAttention's block mask) give the full row's
document-masked attention at their positions. The blocked path gives the whole mask's values and
gradients, and its peak memory follows one block, not the ``S/cp × S`` scores."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from neuron_parallel.batches import IGNORE_INDEX, Batch, causal_rows
from neuron_parallel.config import DataConfig, JobConfig, ParallelConfig
from neuron_parallel.memprof import TensorMemoryProfile
from neuron_parallel.models.causal_lm import document_causal_mask
from neuron_parallel.parallel.context import (
    BlockedMask,
    allowed_block_mask,
    allowed_mask,
    blocked_attention,
    chunk_order,
    document_ids,
    shard_batch,
    shard_index,
    to_global_order,
)
from neuron_parallel.utils import check_context_split


def packed_positions(rows: int, seq: int, seed: int = 0) -> np.ndarray:
    """Rows of documents of random lengths (3 to seq/2 positions), positions restarting at each."""
    rng = np.random.default_rng(seed)
    out = np.zeros((rows, seq), dtype=np.int64)
    for r in range(rows):
        at = 0
        while at < seq:
            n = min(int(rng.integers(3, seq // 2)), seq - at)
            out[r, at : at + n] = np.arange(n)
            at += n
    return out


def test_each_rank_holds_an_early_and_a_late_chunk():
    assert [chunk_order(4, r) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert shard_index(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert shard_index(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    # Every rank's causal work (keys before each of its queries) is the same.
    work = [int((shard_index(64, 4, r) + 1).sum()) for r in range(4)]
    assert len(set(work)) == 1, work


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_the_shards_in_global_order_are_the_row(cp):
    seq = 24 * cp
    row = torch.arange(2 * seq).view(2, seq) * 10
    indices = [shard_index(seq, cp, r) for r in range(cp)]
    assert sorted(np.concatenate(indices).tolist()) == list(range(seq))  # a partition
    assert torch.equal(to_global_order([row[:, i] for i in indices], dim=1), row)
    heads = torch.randn(2, 3, seq, 4)
    assert torch.equal(to_global_order([heads[:, :, i] for i in indices], dim=2), heads)


def test_a_batch_is_cut_on_the_host_with_its_documents_found_on_the_whole_rows():
    seq, cp = 32, 2
    positions = packed_positions(3, seq)
    labels = np.where(np.arange(seq) % 3 == 0, IGNORE_INDEX, np.arange(seq) + 100)[None].repeat(3, 0)
    seq_ids = np.where(labels == IGNORE_INDEX, -1, 0)
    t = torch.from_numpy
    rows = causal_rows(positions, labels)
    batch = Batch(
        t(np.arange(3 * seq).reshape(3, seq)), t(labels), t(positions), causal_rows=rows, sequence_ids=t(seq_ids)
    )
    for r in range(cp):
        index = shard_index(seq, cp, r)
        part = shard_batch(batch, cp, r)
        for name in ("inputs", "labels", "positions", "sequence_ids"):
            assert torch.equal(getattr(part, name), getattr(batch, name)[:, index]), name
        assert torch.equal(part.documents, document_ids(t(positions)))
        assert part.causal_rows == rows and part.causal == batch.causal
        assert part.split(1)[2].documents.shape == (1, seq)
    # A stream row is one document: positions 0..S-1, the causal path.
    stream = shard_batch(Batch(batch.inputs, batch.labels), cp, 1)
    assert torch.equal(stream.positions[0], t(shard_index(seq, cp, 1))) and stream.causal
    assert stream.documents.unique().tolist() == [1]


def test_documents_number_from_the_whole_row():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2]])
    assert document_ids(positions).tolist() == [[1, 1, 1, 2, 2, 3, 3, 3]]


@pytest.mark.parametrize("cp", [2, 4])
def test_each_shards_mask_is_the_full_rows_mask_at_its_queries(cp):
    seq = 16 * cp
    positions = torch.from_numpy(packed_positions(3, seq, seed=cp))
    documents = document_ids(positions)
    # The whole rows' mask by its definition: same document and key not after query.
    full = ((documents[:, :, None] == documents[:, None, :]) & torch.ones(seq, seq, dtype=torch.bool).tril())[:, None]
    assert torch.equal(document_causal_mask(positions), full) and not full.all()
    for r in range(cp):
        index = torch.from_numpy(shard_index(seq, cp, r))
        assert torch.equal(allowed_mask(index, seq, documents), full[:, :, index])
        causal = torch.ones(seq, seq, dtype=torch.bool).tril()[index]
        assert torch.equal(allowed_mask(index, seq, None)[0, 0], causal)


def attention_of_shards(q, k, v, mask_of_rank, cp: int):
    """Every cp rank's output, as the layers compute it: the local queries, the gathered K/V
    (every rank's shard put back in global order) and the rank's mask; then in global order."""
    seq = q.shape[2]
    indices = [torch.from_numpy(shard_index(seq, cp, r)) for r in range(cp)]
    keys = to_global_order([k[:, :, i] for i in indices], dim=2)
    values = to_global_order([v[:, :, i] for i in indices], dim=2)
    outs = [mask_of_rank(q[:, :, i], keys, values, i) for i in indices]
    return to_global_order(outs, dim=2)


@pytest.mark.parametrize("cp", [2, 4])
def test_attention_over_gathered_shards_is_the_full_rows(cp):
    seq, heads, kv_heads, d = 16 * cp, 4, 2, 8
    g = torch.Generator().manual_seed(cp)
    q = torch.randn(2, heads, seq, d, generator=g)
    k, v = (torch.randn(2, kv_heads, seq, d, generator=g) for _ in range(2))
    positions = torch.from_numpy(packed_positions(2, seq, seed=10 + cp))
    documents = document_ids(positions)
    expect = F.scaled_dot_product_attention(q, k, v, attn_mask=document_causal_mask(positions), enable_gqa=True)

    def blocked(q_local, keys, values, index):
        return blocked_attention(q_local, keys, values, BlockedMask(index, seq, documents, q.dtype), block=6)

    got = attention_of_shards(q, k, v, blocked, cp)
    assert (got - expect).abs().max() < 1e-5
    # Without the document mask the shards attend across documents: the check can fail.
    wrong = attention_of_shards(
        q,
        k,
        v,
        lambda ql, ks, vs, i: F.scaled_dot_product_attention(
            ql, ks, vs, attn_mask=allowed_mask(i, seq, None), enable_gqa=True
        ),
        cp,
    )
    assert (wrong - expect).abs().max() > 1e-2


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_the_flex_block_mask_gives_the_additive_masks_outputs():
    from torch.nn.attention.flex_attention import flex_attention

    cp, seq = 2, 256
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, seq, 8, generator=g)
    k, v = (torch.randn(1, 2, seq, 8, generator=g) for _ in range(2))
    positions = torch.from_numpy(packed_positions(1, seq, seed=3))
    documents = document_ids(positions)
    expect = F.scaled_dot_product_attention(q, k, v, attn_mask=document_causal_mask(positions), enable_gqa=True)
    for docs in (documents, None):

        def flex(q_local, keys, values, index, docs=docs):
            mask = allowed_block_mask(index, seq, docs)
            return flex_attention(q_local, keys, values, block_mask=mask, enable_gqa=True)

        got = attention_of_shards(q, k, v, flex, cp)
        want = expect if docs is not None else F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        assert (got - want).abs().max() < 1e-5


def whole_mask_attention(q, keys, values, index, seq, documents):
    """The reference: one scaled-dot-product attention of the local queries under the whole
    ``S/cp × S`` additive mask, the K/V heads repeated for the query heads before it."""
    allowed = allowed_mask(index, seq, documents)
    mask = torch.zeros(allowed.shape).masked_fill_(~allowed, float("-inf"))
    groups = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)


def blocked(q, keys, values, index, seq, documents, block):
    return blocked_attention(q, keys, values, BlockedMask(index, seq, documents, q.dtype), block=block)


def forward_backward(attend, q, keys, values, grad, *args):
    """``attend``'s output and the gradients of its query, key and value inputs for ``grad``."""
    inputs = [t.detach().requires_grad_() for t in (q, keys, values)]
    out = attend(*inputs, *args)
    out.backward(grad)
    return out.detach(), *(t.grad for t in inputs)


@pytest.mark.parametrize("block", [16, 24])
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "causal"])
def test_blocked_attention_gives_the_whole_masks_values_and_gradients(packed, block):
    cp, seq, rows, heads, kv_heads, d = 2, 128, 2, 4, 2, 8  # 64 queries a rank, chunks of 32
    positions = torch.from_numpy(packed_positions(rows, seq, seed=block))
    documents = document_ids(positions) if packed else None
    g = torch.Generator().manual_seed(block)
    keys, values = (torch.randn(rows, kv_heads, seq, d, generator=g) for _ in range(2))
    if packed:  # documents run on across the query blocks and the chunk (shard) boundaries
        for cut in (block, 2 * block, seq // (2 * cp)):
            assert (positions[:, cut] != 0).any(), cut
    for r in range(cp):
        index = torch.from_numpy(shard_index(seq, cp, r))
        q = torch.randn(rows, heads, seq // cp, d, generator=g)
        grad = torch.randn(rows, heads, seq // cp, d, generator=g)
        want = forward_backward(whole_mask_attention, q, keys, values, grad, index, seq, documents)
        got = forward_backward(blocked, q, keys, values, grad, index, seq, documents, block)
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):  # fp32 sums in another order
            assert (a - b).abs().max() <= 1e-6 * b.abs().max(), (name, r, (a - b).abs().max(), b.abs().max())
        assert want[2].abs().max() > 0.1  # every key and value reached through the blocks
        rows_mask = BlockedMask(index, seq, documents, torch.bfloat16).rows(block, 2 * block)
        assert rows_mask.dtype == torch.bfloat16
        assert torch.equal(rows_mask == 0, allowed_mask(index, seq, documents)[:, :, block : 2 * block])


def attention_peak(attend, seq: int, cp: int, heads: int, kv_heads: int, d: int) -> int:
    """Peak tensor bytes allocated during one forward and backward of ``attend`` (the inputs made
    before), on torch's math path: fp32 scores and softmax, as neuron decomposes attention."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, heads, seq // cp, d, generator=g, requires_grad=True)
    keys, values = (torch.randn(1, kv_heads, seq, d, generator=g, requires_grad=True) for _ in range(2))
    grad = torch.randn(1, heads, seq // cp, d, generator=g)
    positions = torch.cat([torch.arange(seq // 3), torch.arange(seq - seq // 3)])[None]
    index, documents = torch.from_numpy(shard_index(seq, cp, 0)), document_ids(positions)
    with sdpa_kernel(SDPBackend.MATH), TensorMemoryProfile() as probe:
        attend(q, keys, values, index, seq, documents).backward(grad)
    return probe.peak()["peak"]


def test_blocked_attention_peaks_at_one_blocks_scores_not_the_whole_masks():
    seq, cp, heads, kv_heads, d, block = 2048, 2, 4, 2, 32, 128
    one_block = heads * block * seq * 4  # one block's fp32 scores: 4 MiB
    whole = attention_peak(whole_mask_attention, seq, cp, heads, kv_heads, d)
    ours = attention_peak(lambda *a: blocked(*a, block), seq, cp, heads, kv_heads, d)
    assert whole > heads * (seq // cp) * seq * 4  # the whole S/cp × S scores (32 MiB) exist at once
    # Scores, probabilities and their gradients of one block, its mask, the repeated K/V and the
    # gradients: a few blocks' worth, never all 8 blocks' scores.
    assert ours < 6 * one_block, (ours, one_block)
    assert ours < whole / 2, (ours, whole)


def test_a_block_size_that_does_not_split_is_refused_with_the_fix():
    check_context_split(512, cp=4)
    check_context_split(100, cp=1)
    with pytest.raises(ValueError, match=r"data.block_size=100 .*parallel.cp=4.*multiple of 8 \(e.g. 104\)"):
        check_context_split(100, cp=4)
    check_context_split(24, cp=2, tp=3, sequence_parallel=True)  # 4 chunks, 12 positions a rank over tp=3
    with pytest.raises(ValueError, match=r"tp=3 \(sequence parallelism\).*multiple of 12"):
        check_context_split(20, cp=2, tp=3, sequence_parallel=True)
    with pytest.raises(ValueError, match=r"data.block_size=20 does not split over parallel.cp=4"):  # the job refuses
        JobConfig(
            model_path="m",
            dataset_path="d",
            output_dir="o",
            data=DataConfig(block_size=20),
            parallel=ParallelConfig(cp=4),
        )
    with pytest.raises(ValueError, match="data.block_size"):  # and the sharding itself
        shard_index(20, 4, 0)
