"""The step-time model of a layout: seconds per optimizer step, by component, for the planner's
ranking (``neuron_parallel.planning.search``). Nothing here imports torch.

* compute: training FLOPs per token as in the PaLM paper's MFU (Chowdhery et al. 2022, appendix
  B: ``6N + 12·L·H·Q·T``; a recomputed layer adds its forward, a third of its training FLOPs;
  under LoRA a frozen weight costs ``4N``, no weight gradient) at ``peak × efficiency`` of the
  hardware kind, the peak of the precision run (``HardwareSpec.peak_flops``: fp32 matmuls for
  ``fp32``, bf16 for ``bf16`` and ``bf16_autocast``), which is also the MFU denominator;
* attention that writes its scores to memory (the ``scores`` and ``score_blocks`` paths of
  ``neuron_parallel.planning.attention``: neuron outside its flash kernel, which every layer
  under context parallelism is): on top of its FLOPs, ``SCORE_PASSES`` passes over the fp32
  ``b·(H/t)·(S/c)·S`` scores per layer at the rank's memory bandwidth (``HardwareSpec.memory_bw``);
  on ``score_blocks`` those bytes are summed over the layer's blocks of queries;
* the blocked attention of context parallelism on neuron and CPU (``attention.BLOCKED``): its
  backward recomputes each block, so every layer runs the attention's forward once more: its
  ``4·H·Q·S`` FLOPs per token and, on neuron, the forward's passes over the scores;
* tensor parallelism: per layer and microbatch 4 collectives of ``b·s·h`` elements (6 with
  recompute; 2 more on a stage holding the embedding or the lm_head), ring cost ``2(t-1)/t``, on
  the node's links (TP never leaves a node): all-reduces, or under sequence parallelism an
  all-gather and a reduce-scatter each;
* context parallelism (``neuron_parallel.parallel.context``): a rank computes its ``S/cp``
  tokens of every row, the matmuls of those tokens and an even share of the attention (the
  load-balanced sharding gives every cp rank the same causal work), so the compute and the
  collectives above count ``b·S/cp`` tokens; per layer and microbatch the K/V exchange: an
  all-gather of the whole row's keys and values (``2·b·S·kv·d`` elements of the compute dtype,
  ``kv`` the rank's KV heads) in forward, a reduce-scatter of their gradients in backward and one
  more all-gather for a recomputed layer, each a ring moving ``(c-1)/c`` of them, not overlapped
  with compute. The mesh is (dp, cp, pp, tp): a cp group spans ``cp·pp·tp`` consecutive ranks,
  on the node's links while that fits in a node, else on the network, where each node carries
  one ring per (pp, tp) coordinate it holds;
* pipeline: ``(m + (p-1)/v)`` microbatch slots of the slowest stage (bubble ``(p-1)/(m+p-1)``,
  interleaved ``(p-1)/(v·m)``), plus the boundary sends; the network when a pp group spans nodes;
* data parallelism: a ring all-reduce ``2(d-1)/d`` of the gradient bytes over the ``d = dp·cp``
  ranks that hold the same parameters (ZeRO-1 adds the updated parameters' broadcast,
  ``(d-1)/d``), counted in full after the step's compute: the engine's reducer
  (``neuron_parallel.parallel.data_parallel.GradReducer``) starts each bucket's all-reduce while
  the last micro-batch's backward runs, an overlap this model does not credit; across nodes each
  node's network carries one ring per co-located replica. The all-reduce runs one call per
  gradient bucket (``BUCKET_BYTES``), ZeRO-1's broadcast one call per dp × cp rank;
* latency (``collective_latency``): every collective call above (and every pipeline send) also
  pays the hardware's fixed latency per call and per step of its ring, NCCL's cost model
  (``hardware.NCCL_RING_LATENCY``), whatever its size: what makes many small collectives (tp at
  short rows, cp's K/V gathers of a short row) cost more than their bytes say.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .attention import BLOCKED, SCORED, attention_path
from .hardware import HardwareSpec
from .lora import adapter_params, trained_in_full
from .model import BUCKET_BYTES, STATES, ModelShape, local_kv_heads

if TYPE_CHECKING:
    from ..config import LoraConfig


SCORE_PASSES = {"forward": 6, "backward": 7}
"""Whole-tensor passes over the fp32 scores of a decomposed attention, a planning estimate from
its steps: forward, the product with K written, the mask added (read, write), the softmax (read,
write), the product with V (read); backward, the probabilities' gradient written, the softmax's
backward (two read, one written), the products with K and Q (read twice)."""


def _across(hw: HardwareSpec, inner: int, span: int) -> float:
    """Bandwidth per rank of a ring over ranks ``inner`` apart that spans ``span`` consecutive
    ranks: the node's links within a node, else the node's network shared by its ``inner``
    rings (at most one per rank)."""
    rpn = hw.ranks_per_node
    return hw.intra_node_bw if span <= rpn else min(hw.intra_node_bw, hw.inter_node_bw / min(inner, rpn))


def links(hw: HardwareSpec, tp: int, pp: int, dp: int, cp: int = 1) -> dict[str, float]:
    """Effective bandwidth (bytes/s per rank) of a pp boundary, of a cp ring and of the gradient
    ring over the dp × cp ranks, on the (dp, cp, pp, tp) mesh."""
    rpn = hw.ranks_per_node
    return {
        "pp": hw.intra_node_bw if tp * pp <= rpn else min(hw.intra_node_bw, hw.inter_node_bw / tp),
        "cp": _across(hw, tp * pp, tp * pp * cp),
        "dp": _across(hw, tp * pp, tp * pp * cp * dp),
    }


def collective_latency(hw: HardwareSpec, ranks: int, span: int, passes: int = 1) -> float:
    """Seconds of latency of one ring collective over ``ranks`` ranks spread over ``span``
    consecutive ranks of the mesh, of ``passes`` passes round the ring (1: an all-gather, a
    reduce-scatter or a broadcast; 2: an all-reduce; a send is a ring of 2 ranks): the per-call
    latency, and per step (``ranks − 1`` per pass) the link latency within a node or the network
    latency for the steps that cross to another node (``nodes − 1`` per pass, as NCCL counts
    them). 0 for a single rank."""
    if ranks <= 1:
        return 0.0
    steps = ranks - 1
    inter = min(steps, -(-span // hw.ranks_per_node) - 1)
    return hw.call_latency + passes * ((steps - inter) * hw.link_latency + inter * hw.network_latency)


def tp_collective_latency(hw: HardwareSpec, tp: int, sp: bool) -> float:
    """Latency of one of tensor parallelism's collectives (``step_time``): an all-reduce over the
    ``tp`` ranks, or under sequence parallelism (``sp``) an all-gather and a reduce-scatter."""
    return 2 * collective_latency(hw, tp, tp) if sp else collective_latency(hw, tp, tp, passes=2)


def kv_exchange_bytes(shape: ModelShape, tp: int, rows: int, seq_len: int, act_bytes: int) -> float:
    """Bytes of the keys and values of ``rows`` whole rows of ``seq_len`` that one layer gathers
    over the cp group on a rank with ``tp``'s share of the KV heads: ``2·b·S·kv·d`` elements."""
    return 2 * rows * seq_len * local_kv_heads(shape.num_kv_heads, tp) * shape.head_dim * act_bytes


def scores_seconds(shape: ModelShape, hw: HardwareSpec, tp: int, cp: int, rows: int, seq_len: int) -> float:
    """Seconds of one pass over the fp32 scores one layer of a decomposed attention writes for
    ``rows`` rows on a rank (its ``H/tp`` heads, its ``S/cp`` queries, the row's ``S`` keys); 0
    where the hardware's memory bandwidth is not modelled."""
    if not hw.memory_bw:
        return 0.0
    return rows * shape.num_heads / tp * (seq_len // cp) * seq_len * 4 / hw.memory_bw


def rank_tokens(c, seq_len: int) -> tuple[int, int]:
    """Rows per pipeline microbatch of layout ``c`` and the tokens a rank holds of them (S/cp a row)."""
    b = c.micro_batch_size // c.num_microbatches
    return b, b * seq_len // c.cp


def forward_flops(shape: ModelShape, seq_len: int) -> tuple[float, float]:
    """Forward FLOPs per token of one decoder layer (its matmuls, and attention over ``seq_len``
    keys) and of the lm_head."""
    return (
        2 * shape.layer_params + 4 * shape.num_heads * shape.head_dim * seq_len,
        2 * shape.vocab_size * shape.hidden_size,
    )


def step_time(
    shape: ModelShape,
    hw: HardwareSpec,
    c,
    seq_len: int,
    layers: list[int],
    lora: LoraConfig | None = None,
    documents: bool = False,
) -> dict:
    """Seconds per optimizer step of layout ``c`` (the planner's ``Candidate``, its memory
    filled in), by component (see the module docstring); ``documents``: rows packed from
    documents (their attention path)."""
    st = STATES[c.precision]
    h, tp, pp, v, cp = shape.hidden_size, c.tp, c.pp, c.virtual_stages, c.cp
    b, tokens = rank_tokens(c, seq_len)
    rate = hw.peak_flops(c.precision) * hw.efficiency
    f_layer, f_head = forward_flops(shape, seq_len)
    f_attn = 4 * shape.num_heads * shape.head_dim * seq_len  # the attention's forward, per token
    f_train, head_passes = 3 * f_layer, 3  # forward, input gradient, weight gradient
    if lora is not None:  # frozen weights: no weight gradient; attention and adapters as before
        f_adapter = 2 * adapter_params(shape, lora)
        f_train = 2 * (f_layer - f_attn) + 3 * (f_attn + f_adapter)
        head_passes = 3 if "lm_head" in trained_in_full(shape, lora) else 2
        f_layer += f_adapter  # what a recomputed layer re-runs
    ring = 2 * (tp - 1) / tp if tp > 1 else 0
    bw = links(hw, tp, pp, c.dp, cp)
    tp_s = ring * tokens * h * st.resid / hw.intra_node_bw + tp_collective_latency(hw, tp, c.sequence_parallel)
    # one exchange: the all-gather (or the reduce-scatter) of K and of V, two calls
    kv_ring = (cp - 1) / cp * kv_exchange_bytes(shape, tp, b, seq_len, st.act) / bw["cp"]
    kv_ring += 2 * collective_latency(hw, cp, tp * pp * cp)
    path = attention_path(hw.device, documents, seq_len, shape.head_dim, cp)
    score_pass = scores_seconds(shape, hw, tp, cp, b, seq_len) if path in SCORED else 0.0
    recomputed_attention = path in BLOCKED
    n_stages = pp * v
    worst = comm_worst = cp_worst = 0.0
    for r in range(pp):
        compute = comm = kv = 0.0
        for sid in range(r, n_stages, pp):
            n = layers[sid]
            rc = sum(1 for j in range(n) if c.activation_checkpointing and j % c.activation_checkpointing == 0)
            head = head_passes * f_head if sid == n_stages - 1 else 0
            again = n * recomputed_attention  # blocked attention: each layer's forward again in backward
            compute += tokens * (f_train * n + f_layer * rc + f_attn * again + head) / tp / rate
            score_passes = (SCORE_PASSES["forward"] + SCORE_PASSES["backward"]) * n
            compute += (score_passes + SCORE_PASSES["forward"] * (rc + again)) * score_pass
            comm += (4 * n + 2 * rc + 2 * (sid in (0, n_stages - 1))) * tp_s
            kv += (2 * n + rc) * kv_ring if cp > 1 else 0.0
        if compute + comm + kv > worst + comm_worst + cp_worst:
            worst, comm_worst, cp_worst = compute, comm, kv
    p2p = 2 * tokens * h * st.resid / (tp if c.sequence_parallel else 1) / bw["pp"] if pp > 1 else 0.0
    p2p += 2 * collective_latency(hw, 2, tp * pp) if pp > 1 else 0.0  # a send forward, one backward
    t_mb = worst + comm_worst + cp_worst + p2p
    slots = c.num_microbatches + (pp - 1) / v
    grad_bytes = c.memory["trainable_numel"] * st.grad
    d = c.dp * cp  # the ranks that hold the same parameters
    dp_s = (2 * (d - 1) / d * grad_bytes + (d - 1) / d * grad_bytes * st.param / st.grad * c.zero_1) / bw["dp"]
    span = tp * pp * d  # one call per bucket; ZeRO-1: one broadcast per owner
    dp_s += max(1, -(-grad_bytes // BUCKET_BYTES)) * collective_latency(hw, d, span, passes=2)
    dp_s += c.zero_1 * d * collective_latency(hw, d, span)
    passes = c.grad_accum * c.num_microbatches
    return {
        "compute_s": passes * worst,
        "tp_comm_s": passes * comm_worst,
        "cp_comm_s": passes * cp_worst,
        "pp_p2p_s": passes * p2p,
        "pp_bubble_s": c.grad_accum * (pp - 1) / v * t_mb,
        "dp_comm_s": dp_s if d > 1 else 0.0,
        "total_s": c.grad_accum * slots * t_mb + (dp_s if d > 1 else 0.0),
    }
