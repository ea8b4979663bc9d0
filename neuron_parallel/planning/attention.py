"""What attention and the loss hold on a rank beyond the rest of a layer, by device and data, for
the memory model (``neuron_parallel.planning.memory``). Nothing here imports torch.

Attention (``attention_path``; the engine's choice is
``neuron_parallel.models.causal_lm.CausalLMStage.document_mask``). A row whose labels all lie in
its first document runs the mask-free causal path on every device; rows packed from several
documents (``documents``: the data carries position ids) attend within their documents:

* ``flash``: no mask, a fused kernel that keeps only the output and the per-row log-sum-exp
  (counted with the layer: ``activations.layer_activation_bytes``). CUDA and CPU on the stream; neuron
  on the stream when torch-neuronx can run its NKI flash kernel: no mask, a sequence that is a
  multiple of ``NKI_FLASH_SEQ_MULTIPLE``, head_dim at most ``NKI_FLASH_MAX_HEAD_DIM`` and no
  dropout (AWS Neuron documentation, TorchNeuron's scaled-dot-product attention).
* ``flex``: CUDA with documents: compiled FlexAttention with a document block mask keeps what
  flash keeps, grouped K/V unrepeated; its block mask (a few int32 per 128×128 block) is left
  out.
* ``mask``: CPU with documents: one additive mask ``b·S²`` in the attention dtype per stage
  forward, kept for backward by every layer's kernel (CPU's flash kernel takes a mask); Hugging
  Face's SDPA with a mask repeats grouped K/V for every query head, so each layer keeps
  ``2·b·S·(q - kv)`` more elements.
* ``scores``: neuron otherwise: a decomposed attention that builds the fp32 ``b·(H/tp)·S²``
  scores. Modelled as torch's own decomposition (the math backend of
  ``scaled_dot_product_attention``) holds it, measured on CPU: each layer keeps the fp32
  softmax output and the repeated K/V for backward (the mask only lives during the forward), and
  a layer's backward holds two more score-sized tensors at once.

Under context parallelism (cp > 1; ``neuron_parallel.parallel.context``) a rank holds ``S/cp``
positions of each row (two chunks, one early, one late) and every layer all-gathers the keys and
values of the whole row over the cp group, then attends under a mask by global index: the local
queries are not a prefix of the row, so no path is mask-free. Per local token (``S/cp`` of them
per row) a layer keeps the gathered K/V of the whole row (``cp`` tokens' worth for each local
one, the K/V heads as they are) instead of its own. CUDA takes ``flex`` (a block mask, no
``S/cp × S`` tensor). Every other device runs the blocked attention of
``neuron_parallel.parallel.context.blocked_attention``: the local queries ``B`` at a time
(``B = CONTEXT_QUERY_BLOCK``, or ``S/cp`` if fewer), each block under activation checkpointing,
so forward keeps nothing of a block but its inputs (the view of the queries, the gathered K/V)
and no mask outlives its block; neuron ``score_blocks`` (each block's attention decomposed into
fp32 scores), CPU ``mask_blocks`` (its fused kernel, given the block's mask). A layer's backward
recomputes one block at a time and then holds, per row: the K/V heads repeated for every query
head and the gradients of those repeated K/V (``2·S·(H/tp)·d`` elements each; three of the four
at once on neuron, whose decomposition frees the repeated V before it forms the repeated K's
gradient, all four in CPU's kernel), the gradients of the gathered K/V accumulated over the
blocks, the query gradient (a block's slice is scattered into a zeroed tensor of all local
queries, then added to the others'), and on neuron three fp32 ``(H/tp)·B·S`` score-sized tensors
(the block's probabilities, their gradient and the softmax's), on CPU the block's additive mask
``B·S`` (one per row with ``documents``, else one the micro-batch's rows share), which its
kernel keeps for backward. That work is counted where it exceeds the layer's MLP tensors, which
are freed by then. Nothing of the kernel is kept from forward to backward, not even the per-row
log-sum-exp a flash kernel keeps (counted with the layer, so taken off here). Measured on CPU
(``blocked_work`` against the allocator, tests/unit/test_planner_attention.py): CPU's kernel
within 1 %, torch's math decomposition over-predicted by 3 % (the accumulated gradients are not
all live at its peak).

The loss (``neuron_parallel.models.causal_lm.lm_head_loss``): a micro-batch of more than
``loss_chunk_tokens`` tokens runs the lm_head and cross-entropy a chunk of tokens at a time under
activation checkpointing: nothing of the logits is kept from forward to backward, and the
backward of one chunk holds the fp32 buffers of that chunk only (``logits_bytes``).
"""

from __future__ import annotations

from ..utils import CONTEXT_QUERY_BLOCK
from .model import ModelShape, StateBytes, local_kv_heads

LOSS_CHUNK_BYTES = 128 << 20
"""The fp32 logits one chunk of the loss may hold per rank: 512 tokens of a vocabulary of 64k
columns (``neuron_parallel.models.causal_lm.lm_head_loss``)."""
NKI_FLASH_SEQ_MULTIPLE = 512
"""torch-neuronx runs its NKI flash attention kernel only on sequences of a multiple of this."""
NKI_FLASH_MAX_HEAD_DIM = 128
"""... and only for head_dim up to this."""
PATHS = ("flash", "flex", "mask", "scores", "mask_blocks", "score_blocks")
BLOCKED = ("mask_blocks", "score_blocks")
"""The paths of context parallelism's blocked attention: backward recomputes the attention's
forward, a block of queries at a time."""
SCORED = ("scores", "score_blocks")
"""The paths that write fp32 scores to memory (all of a layer's, or one block's at a time)."""


def query_block(seq_len: int, cp: int) -> int:
    """Queries per block of the blocked attention under context parallelism: ``CONTEXT_QUERY_BLOCK``,
    or the rank's ``S/cp`` local queries if fewer."""
    return min(CONTEXT_QUERY_BLOCK, seq_len // cp)


def attention_path(device: str, documents: bool, seq_len: int, head_dim: int, cp: int = 1) -> str:
    """The attention path a layer takes on ``device`` (cpu, cuda, neuron), planned for the worst
    micro-batch: with ``documents``, one whose rows need the mask; under context parallelism
    (``cp`` > 1) always masked, blocked but on CUDA (see the module docstring)."""
    if cp > 1:
        return {"cuda": "flex", "neuron": "score_blocks"}.get(device, "mask_blocks")
    if device == "cuda":
        return "flex" if documents else "flash"
    if device == "neuron":
        flash = seq_len % NKI_FLASH_SEQ_MULTIPLE == 0 and head_dim <= NKI_FLASH_MAX_HEAD_DIM
        return "flash" if flash and not documents else "scores"
    return "mask" if documents else "flash"


def attention_bytes(
    shape: ModelShape,
    tp: int,
    seq_len: int,
    st: StateBytes,
    path: str,
    cp: int = 1,
    documents: bool = True,
    rows: int = 1,
) -> dict[str, float]:
    """Per local token (``seq_len / cp`` of a row of ``seq_len``), what ``path`` holds beyond a
    flash kernel on whole rows: ``layer``, kept for backward by every layer whose activations are
    kept; ``mask``, kept once per microbatch by a stage's layers until its backward; ``work``,
    live during one layer's backward (for micro-batches of ``rows`` rows, which may share a
    mask)."""
    if path not in PATHS:
        raise ValueError(f"no attention path {path!r}; one of {PATHS}")
    q = shape.num_heads * shape.head_dim / tp
    kv = local_kv_heads(shape.num_kv_heads, tp) * shape.head_dim
    mlp_freed = 6 * shape.intermediate_size / tp * st.act  # the MLP's 4 saved tensors and 2 gradients
    if path in BLOCKED:
        work = blocked_work(shape, tp, seq_len, st, path, cp, documents, rows) - mlp_freed
        # the gathered K/V instead of the local ones; no log-sum-exp kept
        layer = 2 * (cp - 1) * kv * st.act - 4 * shape.num_heads / tp
        return {"layer": layer, "mask": 0.0, "work": max(0.0, work)}
    none = {"layer": 0.0, "mask": 0.0, "work": 0.0}
    if cp > 1:
        if path != "flex":
            raise ValueError(
                f"attention path {path!r} does not run under context parallelism (cp={cp}); one of {BLOCKED} or flex"
            )
        # the gathered K/V instead of the local ones; in backward their gradients, where they
        # exceed the MLP's freed tensors
        return {**none, "layer": 2 * (cp - 1) * kv * st.act, "work": max(0.0, 2 * cp * kv * st.act - mlp_freed)}
    repeated = 2 * (q - kv) * st.act  # the K/V repeated for every query head
    scores = shape.num_heads / tp * seq_len * 4
    if path == "mask":
        return {**none, "layer": repeated, "mask": seq_len * st.act}
    if path == "scores":  # the mask lives during the forward only
        return {**none, "layer": scores + repeated, "work": 2 * scores}
    return none


def blocked_work(
    shape: ModelShape, tp: int, seq_len: int, st: StateBytes, path: str, cp: int, documents: bool, rows: int = 1
) -> float:
    """Per local token, what the blocked attention of one layer (``path`` one of ``BLOCKED``)
    holds at the peak of its backward beyond its inputs and outputs (the local queries, the
    gathered K/V, the output and its gradient) for micro-batches of ``rows`` rows: one recomputed
    block's kernel tensors, the gradients of the gathered K/V and of the queries (see the module
    docstring)."""
    q = shape.num_heads * shape.head_dim / tp
    kv = local_kv_heads(shape.num_kv_heads, tp) * shape.head_dim
    block = query_block(seq_len, cp)
    if path == "score_blocks":  # three fp32 (H/tp)·B·S tensors per row, and 3 of the 4 repeated K/V
        kernel = 3 * shape.num_heads / tp * block * cp * 4 + 3 * cp * q * st.act
    else:  # the block's additive mask, per row or shared, and all 4 repeated K/V
        kernel = block * cp * st.act / (1 if documents else rows) + 4 * cp * q * st.act
    query_grads = (2 if seq_len // cp > block else 1) * q * st.act
    return kernel + 2 * cp * kv * st.act + query_grads


def loss_chunk_tokens(local_vocab: int, chunk_bytes: int = LOSS_CHUNK_BYTES) -> int:
    """Tokens per chunk of the loss: as many as hold ``chunk_bytes`` of fp32 logits over this
    rank's ``local_vocab`` columns (at least one)."""
    return max(1, chunk_bytes // (4 * local_vocab))


def logits_bytes(shape: ModelShape, tp: int, tokens: int) -> tuple[float, bool]:
    """(bytes of one fp32 logits buffer of the loss, whether the loss is chunked) for a
    microbatch of ``tokens`` tokens: a chunk's buffer, or the whole microbatch's."""
    local_vocab = shape.vocab_size // tp
    chunk = loss_chunk_tokens(local_vocab)
    return min(tokens, chunk) * local_vocab * 4, tokens > chunk


def block_size_advice(
    device: str, documents: bool, seq_len: int, head_dim: int | None = None, cp: int = 1
) -> str | None:
    """A note on ``data.block_size`` and the attention kernel of ``device``, or None (only neuron
    has one): torch-neuronx's NKI flash kernel runs without a mask, on a sequence of a multiple
    of ``NKI_FLASH_SEQ_MULTIPLE`` and head_dim at most ``NKI_FLASH_MAX_HEAD_DIM``; elsewhere
    attention builds fp32 scores, which the plan counts: under context parallelism (``cp`` > 1)
    those of one block of queries at a time, recomputed in backward. A note, never a refusal."""
    if device != "neuron":
        return None
    scores = "every layer builds fp32 batch·heads·S² attention scores (counted in the plan)"
    if cp > 1:
        return (
            f"under context parallelism (parallel.cp={cp}) every layer attends through a mask, which "
            "torch-neuronx's NKI flash kernel does not take: attention runs up to "
            f"{CONTEXT_QUERY_BLOCK} queries at a time, each block building fp32 batch·heads·{CONTEXT_QUERY_BLOCK}·S "
            "scores, and backward recomputes every block (counted in the plan)"
        )
    if head_dim is not None and head_dim > NKI_FLASH_MAX_HEAD_DIM:
        return f"head_dim={head_dim} exceeds the {NKI_FLASH_MAX_HEAD_DIM} of torch-neuronx's NKI flash kernel: {scores}"
    if seq_len % NKI_FLASH_SEQ_MULTIPLE:
        fit = -(-seq_len // NKI_FLASH_SEQ_MULTIPLE) * NKI_FLASH_SEQ_MULTIPLE
        return (
            f"data.block_size={seq_len} is not a multiple of {NKI_FLASH_SEQ_MULTIPLE}, which torch-neuronx's NKI "
            f"flash attention kernel needs, so {scores}; use a block_size that is a multiple of "
            f"{NKI_FLASH_SEQ_MULTIPLE} (e.g. {fit})"
        )
    if documents:
        return (
            "rows packed from several documents attend through a mask, which torch-neuronx's NKI flash kernel "
            f"does not take: there {scores}; rows whose labels lie in their first document run the flash kernel"
        )
    return None
