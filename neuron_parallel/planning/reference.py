"""What the reference forward of DPO under LoRA adds to a training step. Nothing here imports torch.

DPO's reference model is, under LoRA, the frozen base itself (``train.objective: dpo`` with
``train.lora``): every micro-batch also runs the base's forward with the adapters off, without
autograd, for the reference's log-probabilities (``neuron_parallel.engine``; under pipeline
parallelism a forward-only pass of its own through every stage,
``neuron_parallel.parallel.pipeline_losses.reference_runner``). DPO fine-tuning every weight reads the
reference step's values instead, and the other objectives have no reference: neither adds
anything.

* time: one more forward of the base per micro-batch, as ``neuron_parallel.planning.timing``
  counts a forward: ``2·N + 4·L·H·Q·T`` FLOPs per token of the layers plus the lm_head's
  ``2·V·h``, at the same rate; per layer the forward's 2 tp collectives (one more on a stage
  holding the embedding or the lm_head), the forward passes over a decomposed attention's scores
  and cp's K/V all-gather, each collective with its latency (``timing.collective_latency``).
  Under pp the pass has its own ``(m + (p-1)/v)`` microbatch slots of the slowest stage's forward
  and one boundary send per microbatch.
* memory: the pass saves nothing for backward; what counts is its transient peak where it runs.
  Without a pipeline it runs after the policy's forward of the same micro-batch, whose saved
  activations are all live: beyond them, one layer's forward work (at the MLP the normalised
  input, ``silu(gate)``, ``up`` and their product; or the attention path's tensors) or, on the
  last stage, a loss chunk's fp32 logits and their log-softmax. Under pp it runs before the
  training pass (nothing of it is live, the pipeline's buffers are), and torch's forward cache
  keeps every microbatch's stage output until the pass ends; its runner's own receive buffers,
  one activation per microbatch and stage input, are held for the whole run, in every phase.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .attention import SCORED, attention_path
from .hardware import HardwareSpec
from .model import STATES, ModelShape
from .timing import (
    SCORE_PASSES,
    collective_latency,
    forward_flops,
    kv_exchange_bytes,
    links,
    rank_tokens,
    scores_seconds,
    tp_collective_latency,
)

if TYPE_CHECKING:
    from ..config import LoraConfig


def reference_forward(objective: str, lora: LoraConfig | None) -> bool:
    """Whether every micro-batch also runs a forward of the frozen base with its adapters off,
    without gradients: DPO under LoRA, whose reference model is that base."""
    return objective == "dpo" and lora is not None


def forward_work(shape: ModelShape, tp: int, act: int, attention_work: float = 0.0) -> float:
    """Bytes per token one decoder layer's forward holds at its peak without autograd, beyond its
    input: the normalised input (whole, as the projections take it under SP), then the larger
    of the MLP's ``silu(gate)``, ``up`` and product and the attention path's work
    (``attention.attention_bytes``), at ``act`` bytes per element."""
    h, i = shape.hidden_size, shape.intermediate_size
    return h * act + max(3 * i / tp * act, attention_work)


def reference_memory(rank, *, grads: float, grad_accum: int) -> tuple[dict, float]:
    """The ``StageMemory`` fields (less the model states) of the moment the reference forward
    runs on the rank whose activation sizes are ``rank`` (``memory._RankActivations``), and the
    receive buffers its pipeline pass holds for the whole run (0 without a pipeline), which
    every other phase holds too. ``grads``: the bytes of all trainable gradients, which exist at
    that moment when earlier micro-batches of the step have run (``grad_accum > 1``)."""
    st, tokens, m = rank.st, rank.tokens, rank.num_microbatches
    work = tokens * forward_work(rank.shape, rank.tp, st.act, rank.attention_work)
    if rank.last:
        work = max(work, 2 * rank.logits)  # a chunk's fp32 logits and their log-softmax
    training_buffers = rank.held(0)[2]
    if rank.pp == 1:
        acts, buffers = rank.held(1)[0], 0.0  # the policy's forward of the micro-batch, saved
    else:
        acts = 0.0
        buffers = sum(1 for sid in rank.ids if sid > 0) * m * rank.boundary
        work += m * len(rank.ids) * rank.boundary  # every microbatch's stage outputs, cached
    fields = dict(
        grads=grads if grad_accum > 1 else 0.0,
        activations=acts,
        pipeline_buffers=training_buffers + buffers,
        transient=work,
        phase="reference",
    )
    return fields, buffers


def reference_seconds(
    shape: ModelShape, hw: HardwareSpec, c, seq_len: int, layers: list[int], documents: bool = False
) -> float:
    """Seconds per optimizer step of the reference forward of layout ``c`` (the planner's
    ``Candidate``; ``layers``: the layer count of every stage), see the module docstring."""
    st = STATES[c.precision]
    h, tp, pp, v, cp = shape.hidden_size, c.tp, c.pp, c.virtual_stages, c.cp
    b, tokens = rank_tokens(c, seq_len)
    rate = hw.peak_flops(c.precision) * hw.efficiency
    f_layer, f_head = forward_flops(shape, seq_len)
    ring = 2 * (tp - 1) / tp if tp > 1 else 0
    bw = links(hw, tp, pp, c.dp, cp)
    tp_s = ring * tokens * h * st.resid / hw.intra_node_bw + tp_collective_latency(hw, tp, c.sequence_parallel)
    kv_ring = (cp - 1) / cp * kv_exchange_bytes(shape, tp, b, seq_len, st.act) / bw["cp"] if cp > 1 else 0.0
    kv_ring += 2 * collective_latency(hw, cp, tp * pp * cp)  # the all-gathers of K and of V
    scored = attention_path(hw.device, documents, seq_len, shape.head_dim, cp) in SCORED
    score_pass = scores_seconds(shape, hw, tp, cp, b, seq_len) if scored else 0.0
    n_stages = pp * v
    worst = 0.0
    for r in range(pp):
        t = 0.0
        for sid in range(r, n_stages, pp):
            n, ends = layers[sid], sid in (0, n_stages - 1)
            t += tokens * (f_layer * n + (f_head if sid == n_stages - 1 else 0)) / tp / rate
            t += SCORE_PASSES["forward"] * n * score_pass + n * kv_ring
            t += (2 * n + ends) * tp_s
        worst = max(worst, t)
    p2p = tokens * h * st.resid / (tp if c.sequence_parallel else 1) / bw["pp"] if pp > 1 else 0.0
    p2p += collective_latency(hw, 2, tp * pp) if pp > 1 else 0.0
    return c.grad_accum * (c.num_microbatches + (pp - 1) / v) * (worst + p2p)
