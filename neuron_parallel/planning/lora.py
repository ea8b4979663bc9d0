"""What low-rank adapters (``train.lora``) change in a rank's parameters and compute.

LoRA keeps the base weights frozen and trains, for each target projection of every decoder
layer, ``A`` (r × in_features) and ``B`` (out_features × r), in fp32, plus the
``modules_to_save`` in full. Under tensor parallelism an adapter follows its layer:
column-parallel projections (q, k, v, gate, up) shard ``B`` on its output dim and replicate
``A``; row-parallel ones (o, down) shard ``A`` on its input dim and replicate ``B``; with KV
heads replicated (tp > num_kv_heads), k's and v's ``B`` holds the rank's one KV head, like the
weight. Gradients, AdamW state and ZeRO-1's shards exist for the trainable tensors only.

What it does to the activations is modelled in ``activations.layer_activation_bytes``; the compute
here: a frozen weight needs no weight gradient, so its matmul costs forward + input gradient
(2 × the forward) instead of 3 ×; attention and the adapters cost 3 × their forward.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .model import ModelShape, local_kv_heads, stage_params

if TYPE_CHECKING:
    from ..config import LoraConfig

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""A decoder layer's projections, in ``stage_params`` order."""
SAVABLE = ("embed_tokens", "lm_head")


def projection_dims(shape: ModelShape, tp: int) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of each projection's weight on one tp rank."""
    h, d, i = shape.hidden_size, shape.head_dim, shape.intermediate_size
    q, kv = shape.num_heads * d // tp, local_kv_heads(shape.num_kv_heads, tp) * d
    return {
        "q_proj": (q, h),
        "k_proj": (kv, h),
        "v_proj": (kv, h),
        "o_proj": (h, q),
        "gate_proj": (i // tp, h),
        "up_proj": (i // tp, h),
        "down_proj": (h, i // tp),
    }


def adapter_numels(shape: ModelShape, lora: LoraConfig, tp: int) -> list[int]:
    """Local numel of ``A`` then ``B`` of each target's adapter in one decoder layer on one tp rank
    (the rank's share of the layer's in/out dims, so replicated halves come out whole)."""
    dims = projection_dims(shape, tp)
    out = []
    for name in PROJECTIONS:
        if name in lora.target_modules:
            n_out, n_in = dims[name]
            out += [lora.r * n_in, n_out * lora.r]
    return out


def trained_in_full(shape: ModelShape, lora: LoraConfig) -> set[str]:
    """The ``modules_to_save`` trained in full; with tied embeddings one weight is both, so
    naming either trains it."""
    saved = set(lora.modules_to_save) & set(SAVABLE)
    return set(SAVABLE) if saved and shape.tie_word_embeddings else saved


def lora_stage_params(
    shape: ModelShape, lora: LoraConfig, tp: int, n_layers: int, first: bool, last: bool
) -> tuple[list[tuple[int, bool]], int]:
    """(local numel, is_matrix) of every trainable tensor one stage holds on a tp rank (embedding
    if trained, the adapters layer by layer, lm_head if trained), and the numel of its frozen
    base parameters."""
    vocab = shape.vocab_size // tp * shape.hidden_size
    full = trained_in_full(shape, lora)
    embed = first and "embed_tokens" in full
    head = last and "lm_head" in full and not (first and shape.tie_word_embeddings)  # tied: one Parameter
    trainable = [(vocab, True)] * embed + [(n, True) for n in adapter_numels(shape, lora, tp)] * n_layers
    trainable += [(vocab, True)] * head
    frozen = sum(n for n, _ in stage_params(shape, tp, n_layers, first, last)) - vocab * (embed + head)
    return trainable, frozen


def frozen_layer_matrices(shape: ModelShape, tp: int) -> int:
    """Numel of a decoder layer's projection weights on one tp rank (all frozen under LoRA)."""
    return sum(o * i for o, i in projection_dims(shape, tp).values())


def adapter_params(shape: ModelShape, lora: LoraConfig) -> int:
    """Adapter parameters of one decoder layer, unsharded."""
    return sum(adapter_numels(shape, lora, 1))


def trainable_parameters(shape: ModelShape, lora: LoraConfig) -> int:
    """Parameters trained in the whole model: every layer's adapters and the modules trained in
    full (one weight when the embeddings are tied)."""
    full = trained_in_full(shape, lora)
    n_full = (1 if shape.tie_word_embeddings else len(full)) if full else 0
    return shape.num_layers * adapter_params(shape, lora) + n_full * shape.vocab_size * shape.hidden_size


def lora_flops_per_token(shape: ModelShape, lora: LoraConfig, seq_len: int) -> float:
    """Training FLOPs per token under LoRA: ``ModelShape.flops_per_token``'s ``6·N + 12·L·H·Q·T``
    with the frozen matmul weights at 4 (forward and input gradient), the adapters and any
    lm_head trained in full at 6; the attention term unchanged."""
    h, L = shape.hidden_size, shape.num_layers
    head = shape.vocab_size * h
    n_frozen = L * shape.layer_params + h + head
    flops = 4 * n_frozen + 6 * L * adapter_params(shape, lora) + 2 * head * ("lm_head" in trained_in_full(shape, lora))
    return flops + 12 * L * shape.num_heads * shape.head_dim * seq_len


def describe_lora(lora: LoraConfig | None) -> str:
    """``LoRA r=8 (7 projections)``, ``LoRA r=16 (q_proj, v_proj; + lm_head)``, or
    ``full fine-tuning``."""
    if lora is None:
        return "full fine-tuning"
    targets = lora.target_modules
    where = f"{len(targets)} projections" if set(targets) == set(PROJECTIONS) else ", ".join(targets)
    full = f"; + {', '.join(lora.modules_to_save)}" if lora.modules_to_save else ""
    return f"LoRA r={lora.r} ({where}{full})"
