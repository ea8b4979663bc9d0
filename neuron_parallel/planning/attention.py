"""What attention and the loss hold on a rank beyond the rest of a layer, by device and data, for
the memory model (``neuron_parallel.planning.memory``). Nothing here imports torch.

Attention (``attention_path``; the engine's choice is
``neuron_parallel.models.causal_lm.CausalLMStage.document_mask``). A row whose labels all lie in
its first document runs the mask-free causal path on every device; rows packed from several
documents (``documents``: the data carries position ids) attend within their documents:

* ``flash``: no mask, a fused kernel that keeps only the output and the per-row log-sum-exp
  (counted with the layer: ``memory.layer_activation_bytes``). CUDA and CPU on the stream; neuron
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

The loss (``neuron_parallel.models.causal_lm.lm_head_loss``): a micro-batch of more than
``loss_chunk_tokens`` tokens runs the lm_head and cross-entropy a chunk of tokens at a time under
activation checkpointing: nothing of the logits is kept from forward to backward, and the
backward of one chunk holds the fp32 buffers of that chunk only (``logits_bytes``).
"""

from __future__ import annotations

from .model import ModelShape, StateBytes, local_kv_heads

LOSS_CHUNK_BYTES = 128 << 20
"""The fp32 logits one chunk of the loss may hold per rank: 512 tokens of a vocabulary of 64k
columns (``neuron_parallel.models.causal_lm.lm_head_loss``)."""
NKI_FLASH_SEQ_MULTIPLE = 512
"""torch-neuronx runs its NKI flash attention kernel only on sequences of a multiple of this."""
NKI_FLASH_MAX_HEAD_DIM = 128
"""... and only for head_dim up to this."""
PATHS = ("flash", "flex", "mask", "scores")


def attention_path(device: str, documents: bool, seq_len: int, head_dim: int) -> str:
    """The attention path a layer takes on ``device`` (cpu, cuda, neuron), planned for the worst
    micro-batch: with ``documents``, one whose rows need the mask (see the module docstring)."""
    if device == "cuda":
        return "flex" if documents else "flash"
    if device == "neuron":
        flash = seq_len % NKI_FLASH_SEQ_MULTIPLE == 0 and head_dim <= NKI_FLASH_MAX_HEAD_DIM
        return "flash" if flash and not documents else "scores"
    return "mask" if documents else "flash"


def attention_bytes(shape: ModelShape, tp: int, seq_len: int, st: StateBytes, path: str) -> dict[str, float]:
    """Per token, what ``path`` holds beyond the flash path: ``layer``, kept for backward by every
    layer whose activations are kept; ``mask``, kept once per microbatch by a stage's layers until
    its backward; ``work``, live during one layer's backward."""
    if path not in PATHS:
        raise ValueError(f"no attention path {path!r}; one of {PATHS}")
    q = shape.num_heads * shape.head_dim / tp
    repeated = 2 * (q - local_kv_heads(shape.num_kv_heads, tp) * shape.head_dim) * st.act
    scores = shape.num_heads / tp * seq_len * 4
    if path == "mask":
        return {"layer": repeated, "mask": seq_len * st.act, "work": 0.0}
    if path == "scores":
        return {"layer": scores + repeated, "mask": 0.0, "work": 2 * scores}
    return {"layer": 0.0, "mask": 0.0, "work": 0.0}


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


def block_size_advice(device: str, documents: bool, seq_len: int, head_dim: int | None = None) -> str | None:
    """A note on ``data.block_size`` and the attention kernel of ``device``, or None (only neuron
    has one): torch-neuronx's NKI flash kernel runs without a mask, on a sequence of a multiple
    of ``NKI_FLASH_SEQ_MULTIPLE`` and head_dim at most ``NKI_FLASH_MAX_HEAD_DIM``; elsewhere
    attention builds fp32 scores, which the plan counts. A note, never a refusal."""
    if device != "neuron":
        return None
    scores = "every layer builds fp32 batch·heads·S² attention scores (counted in the plan)"
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
