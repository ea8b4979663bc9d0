"""What one decoder layer saves for backward, per token, by tensor group: the activation part of
the memory model (``neuron_parallel.planning.memory``, whose docstring says what is counted and
why: Hugging Face's Llama block under a flash kernel and this library's DTensor TP/SP plan, full
fine-tuning and LoRA). What attention adds on other paths and under context parallelism is
``neuron_parallel.planning.attention``'s. Nothing here imports torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .model import ModelShape, StateBytes, local_kv_heads

if TYPE_CHECKING:
    from ..config import LoraConfig


def norm_bytes(
    h: int, tp: int, sp: bool, st: StateBytes, consumers: int = 1, *, frozen: bool = False, dropout: bool = False
) -> float:
    """Per token, one RMSNorm (HF computes it in fp32) and the block input it feeds: the fp32
    normalised tensor (plus an fp32 copy of a bf16 input and the cast back), seq-sharded under
    SP, and the input the next projections save, whole (under SP the all-gathered copy, the local
    norm output being freed); under autocast each of the ``consumers`` projections saves its
    own bf16 cast. A ``frozen`` norm weight keeps only the fp32 copy of a bf16 input; with
    ``dropout`` each consumer (a LoRA adapter) saves its own dropped input and 1-byte mask."""
    seq = tp if sp else 1
    if frozen:
        internal = 4 if st.resid != 4 else 0
    else:
        internal = 4 + (4 + st.act if st.resid != 4 else 0)
    if dropout:
        return h * internal / seq + consumers * h * (st.act + 1)
    return h * internal / seq + h * st.act * (consumers if st.autocast else min(consumers, 1))


def layer_activation_bytes(
    shape: ModelShape, tp: int, sp: bool, st: StateBytes, lora: LoraConfig | None = None
) -> dict[str, float]:
    """Bytes per token one decoder layer saves for backward, by tensor group (see module doc)."""
    h, d, i = shape.hidden_size, shape.head_dim, shape.intermediate_size
    seq = tp if sp else 1
    q = shape.num_heads * d / tp
    kv = local_kv_heads(shape.num_kv_heads, tp) * d
    # rotary q and k, v and the sdpa output (already in (b, s, heads, d) layout, so HF's
    # transpose().contiguous() copies nothing); the fp32 log-sum-exp per head
    attention = (2 * q + 2 * kv) * st.act + 4 * shape.num_heads / tp
    if lora is None:
        return {
            "residual": 2 * h * st.resid / seq,  # inputs of the attention and MLP blocks
            "norms": norm_bytes(h, tp, sp, st, consumers=3) + norm_bytes(h, tp, sp, st, consumers=2),
            "attention": attention,
            "mlp": 4 * i / tp * st.act,  # gate, up, silu(gate), silu(gate)*up
        }
    targets, drop = set(lora.target_modules), lora.dropout > 0
    kw = dict(frozen=True, dropout=drop)
    return {
        "residual": 2 * h * st.resid / seq,
        "norms": norm_bytes(h, tp, sp, st, len(targets & {"q_proj", "k_proj", "v_proj"}), **kw)
        + norm_bytes(h, tp, sp, st, len(targets & {"gate_proj", "up_proj"}), **kw),
        # sdpa saves its output anyway; o_proj's adapter adds a dropped copy and its mask
        "attention": attention + ("o_proj" in targets and drop) * q * (st.act + 1),
        # gate, up, silu(gate); silu(gate)*up only for down_proj's adapter (dropped, with a mask)
        "mlp": 3 * i / tp * st.act + ("down_proj" in targets) * i / tp * (st.act + drop),
        "adapters": len(targets) * lora.r * st.act,  # each A's output, saved by its B
    }
