"""What one rank holds while training a Llama-family model: a model of peak memory per rank.

The model is of *this* library's engine (``neuron_parallel.engine``), tensor by tensor:

* model states (``STATES``): ``fp32`` is what the engine keeps: fp32 parameters and gradients
  (4 + 4 bytes/param) and AdamW's fp32 ``exp_avg``/``exp_avg_sq`` (8), the 8 sharded by ZeRO-1.
  ``bf16`` is the mixed-precision Adam of the ZeRO paper (Rajbhandari et al. 2020, "ZeRO: Memory
  Optimizations Toward Training Trillion Parameter Models", figure 1): bf16 params + grads
  (2 + 2) and fp32 master, m, v (12), the 12 sharded: ``4Ψ + 12Ψ/dp``. ``bf16_autocast`` is the
  engine's ``mixed_precision="bf16"``: fp32 states as ``fp32``, bf16 activations, plus the bf16
  weight copies autocast caches for the step (2 bytes/param).
  ZeRO-1 here is ``torch.distributed.optim.ZeroRedundancyOptimizer``: whole parameters, placed
  largest first on the least-loaded dp rank, per parameter group (matrices, then vectors);
  ``zero_partition`` replays that placement exactly.
* activations saved for backward, per decoder layer and token, read off the autograd graph of
  Hugging Face's Llama block under a flash attention kernel (no ``5as/h`` score term of
  Korthikanti et al.'s GPT formula) and of our DTensor TP/SP plan; see
  ``layer_activation_bytes``. Sequence parallelism shards the residual stream and norms, but
  the all-gathered input of attention and of the MLP is saved whole by the projections
  (DTensor does not re-gather in backward as Megatron does), so our SP saves ``2h`` per token
  more than Korthikanti's ``34/t``. Full recompute keeps the layer input only. What another
  attention path of the device and data adds (an explicit mask on CPU, fp32 scores on neuron)
  is ``neuron_parallel.planning.attention``'s.
* the loss: three fp32 ``b·s·V/tp`` buffers at the start of a microbatch's backward (log-softmax
  output, its incoming and its outgoing gradient; under tp ``loss_parallel`` also keeps the
  logits: four), ``b·s`` the tokens of one chunk of the loss (``attention.logits_bytes``); other
  in-flight microbatches keep their log-softmax unless the loss is chunked, which keeps nothing
  of the logits until backward but the fp32 final-norm output the chunks start from. A
  pipeline's last stage caches its output, the final norm's, in its forward cache.
* pipeline buffers: ``torch.distributed.pipelining`` allocates one activation receive buffer
  and one gradient receive buffer per microbatch, for the whole run, and caches each in-flight
  stage output; 1F1B keeps ``p - r`` microbatches in flight on pp rank ``r``, GPipe all ``m``,
  interleaved 1F1B ``(v-1)·m_round + 2(p-1-r) + 1`` chunks (torch's warm-up counts).
* transients: a layer's backward (two ``b·s·i/tp`` MLP gradients beyond what it saved, and the
  attention path's work), a recomputed layer, the dp reduction's flat bucket on the first step
  (``GradReducer`` of ``neuron_parallel.parallel.data_parallel``: up to ``BUCKET_BYTES``; see
  ``max_bucket``), AdamW's per-parameter temporaries (``sqrt`` and the division: 2 × the largest
  owned parameter, fp32).
* the dp reduction's flat buckets: ``GradReducer`` keeps them from step to step, the size of
  the trainable gradients, beside the gradients backward makes (the step's gradients are views
  into them).
* context parallelism (cp > 1): every activation above for the rank's ``S/cp`` tokens of each
  row; the gathered K/V of the whole row, and in a layer's backward the attention's work (on
  neuron and CPU one recomputed block of queries at a time) as
  ``neuron_parallel.planning.attention`` counts them; the gradient reduction and the ZeRO-1
  shards over the dp × cp ranks.

Gradients are freed after every step (``zero_grad(set_to_none=True)``), so the peak is the
largest of a few moments: the start of backward (every saved activation and the loss buffers;
the grads of earlier microbatches only with accumulation, or on a pipeline stage after its
first backward), the end of backward (all grads, the first layer's tensors and its backward),
and the optimizer step (all grads, and the larger of the reduction's buckets and AdamW's
temporaries; the buckets are counted there although ``GradReducer`` copies most of them while the
last micro-batch's backward runs).

Calibration: every constant above was read off the autograd graph and the code (not fitted),
then checked against allocator measurements of real training steps in bench/planner.py: 14 fp32
cases on CPU (dp, tp, sp, pp with 1F1B and GPipe, cp, ZeRO-1, recompute, KV replication) and 2 of
the engine's bf16 autocast mode, every rank within 2.2 % but the recomputed ones, over-predicted
by up to 6.2 % (3.7 % on one rank; with dp, at the end of backward the reduction's buckets
already hold most gradients, which the model counts twice). ``bf16`` (bf16 parameters, as in the ZeRO
paper and NxD) reuses the same tensor list with 2-byte activations; no engine mode here runs it,
so it is not measured. The attention paths and the chunked loss are checked against the tensor
bytes of a stage's forward and backward on CPU in tests/unit/test_planner_attention.py.

LoRA (``lora``, a ``neuron_parallel.config.LoraConfig``; ``neuron_parallel.planning.lora``): the
frozen base weights at the precision's parameter bytes, the adapters and ``modules_to_save`` as
trainable tensors with the precision's grad, optimizer (ZeRO-1 sharded) and autocast-cache bytes,
and nothing else of the states. Activations, read off the autograd graph of the same block with
frozen base weights and adapters (``x + s·B(A(dropout(x)))``): a frozen weight's matmul saves
the weight, not its input, so a projection's input is saved by its adapter's ``A`` only (and not
at all for a projection without one); a norm with a frozen weight does not keep its normalised
tensor; each adapter saves its ``r``-wide ``A`` output; dropout makes each adapter save its own
dropped input and a 1-byte mask (the fused kernel of CUDA and Neuron; CPU's unfused dropout
keeps a mask of the input's dtype, so there dropout costs more than predicted). Under autocast,
torch caches the bf16 copies of trainable weights only: a frozen weight is cast at every forward
and the copy is saved for backward, so every layer whose activations are held also holds its
weights' bf16 copies. The loss, pipeline buffers and a layer's backward work are those of full
fine-tuning. With ``lora=None`` every number is that of full fine-tuning. Checked per layer
against the saved tensors of Hugging Face's block (tests/unit/test_planner_lora.py, exact) and
in bench/planner.py against 6 LoRA training runs of the engine (1 rank fp32 and bf16 autocast,
tp2 + SP, pp2 1F1B, dp2 ZeRO-1 with the lm_head trained, tp4 with KV replication): every rank
within 2.5 %.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

from ..utils import split_layers
from .activations import layer_activation_bytes, norm_bytes
from .attention import attention_bytes, attention_path, logits_bytes
from .lora import frozen_layer_matrices, lora_stage_params, trained_in_full
from .model import (
    BUCKET_BYTES,
    HF_NAMES,
    STATES,
    ModelShape,
    StateBytes,
    local_kv_heads,
    max_bucket,
    model_states_bytes,
    stage_params,
    zero_partition,
)
from .reference import reference_forward, reference_memory

if TYPE_CHECKING:
    from ..config import LoraConfig

__all__ = [  # re-exported
    "BUCKET_BYTES",
    "HF_NAMES",
    "STATES",
    "ModelShape",
    "StateBytes",
    "layer_activation_bytes",
    "local_kv_heads",
    "max_bucket",
    "model_states_bytes",
    "norm_bytes",
    "stage_params",
    "zero_partition",
]

GiB = 1 << 30


COMPONENTS = ("params", "grads", "optimizer", "activations", "loss", "pipeline_buffers", "transient", "comm_buffers")


@dataclass(slots=True)
class StageMemory:
    """Predicted peak tensor bytes of one rank, by component (``total`` sums them); ``phase`` is
    where the peak falls: ``backward`` (activations live) or ``step`` (reduction/optimizer);
    ``numel`` counts the rank's parameters, ``trainable_numel`` those it computes gradients for
    (all of them but under LoRA)."""

    params: float = 0
    grads: float = 0
    optimizer: float = 0
    activations: float = 0
    loss: float = 0
    pipeline_buffers: float = 0
    transient: float = 0
    comm_buffers: float = 0
    phase: str = "backward"
    numel: int = 0
    trainable_numel: int = 0

    @property
    def total(self) -> float:  # the sum over COMPONENTS, written out: a search adds up many
        return (
            self.params
            + self.grads
            + self.optimizer
            + self.activations
            + self.loss
            + self.pipeline_buffers
            + self.transient
            + self.comm_buffers
        )

    def as_dict(self) -> dict:
        out: dict = {k: int(getattr(self, k)) for k in COMPONENTS}
        out.update(total=int(self.total), phase=self.phase, param_numel=self.numel)
        out.update(trainable_numel=self.trainable_numel)
        return out


def inflight_chunks(schedule: str, pp: int, rank: int, m: int, v: int = 1) -> int:
    """Model chunks (a stage's layers for one microbatch) whose activations pp rank ``rank``
    holds at once, from the warm-up counts of torch's schedules."""
    if pp == 1:
        return 1
    if schedule == "gpipe":
        return m
    if schedule == "1f1b":
        return min(m, pp - rank)
    if schedule == "interleaved_1f1b":
        per_round = m // max(1, m // pp)
        return min(m * v, (v - 1) * per_round + 2 * (pp - 1 - rank) + 1)
    raise ValueError(f"no memory model for pipeline schedule {schedule!r}; use gpipe, 1f1b or interleaved_1f1b")


_PARAMETERS: dict[tuple, tuple] = {}
"""``_rank_parameters`` by its arguments: a search evaluates the same model states for every
activation option of a split."""


def _rank_parameters(
    shape: ModelShape,
    st: StateBytes,
    *,
    tp: int,
    dp: int,
    zero_1: bool,
    layers: list[int],
    ids: list[int],
    n_stages: int,
    dp_rank: int | None,
    lora: LoraConfig | None = None,
) -> tuple[tuple[tuple[int, bool], ...], dict, int]:
    """The model states of the rank holding the stages ``ids``: (numel, is_matrix) of its every
    trainable parameter, the ``StageMemory`` fields of its parameters and its ZeRO-1 share of the
    optimizer state (dp rank ``dp_rank``, default the most loaded), and the largest parameter it
    updates. Under ``lora`` the frozen base counts as parameters only."""
    key = (shape, st, tp, dp, zero_1, tuple(layers), tuple(ids), n_stages, dp_rank, repr(lora))
    if key not in _PARAMETERS:
        if len(_PARAMETERS) >= 4096:
            _PARAMETERS.clear()
        _PARAMETERS[key] = _parameters(shape, st, tp, dp, zero_1, layers, ids, n_stages, dp_rank, lora)
    sizes, states, largest = _PARAMETERS[key]
    return sizes, dict(states), largest


def _parameters(shape, st, tp, dp, zero_1, layers, ids, n_stages, dp_rank, lora) -> tuple:
    """``_rank_parameters``, computed."""
    sizes, frozen = [], 0
    for sid in ids:
        first, last = sid == 0, sid == n_stages - 1
        if lora is None:
            sizes += stage_params(shape, tp, layers[sid], first, last)
        else:
            trainable, base = lora_stage_params(shape, lora, tp, layers[sid], first, last)
            sizes, frozen = sizes + trainable, frozen + base
    numel = sum(n for n, _ in sizes)
    part = zero_partition(tuple(sizes), dp) if zero_1 and dp > 1 else ((numel, max(n for n, _ in sizes)),)
    owned, largest = part[dp_rank] if dp_rank is not None and len(part) > 1 else max(part)
    states = dict(
        params=frozen * st.param + numel * (st.param + st.cast_cache),
        optimizer=owned * st.sharded,
        numel=frozen + numel,
        trainable_numel=numel,
    )
    return tuple(sizes), states, largest


@dataclass(frozen=True, slots=True)
class _RankActivations:
    """What one microbatch puts on a pp rank, by model chunk: the sizes the phases of
    ``stage_memory`` combine with the number of microbatches in flight."""

    shape: ModelShape
    st: StateBytes
    tp: int
    sp: bool
    pp: int
    num_microbatches: int
    ids: list[int]  # stage ids of the rank's model chunks, one per virtual stage
    n_stages: int
    tokens: int  # tokens of one microbatch
    per_layer: float  # bytes per token a decoder layer saves without recompute
    boundary: float  # one microbatch crossing a stage boundary
    chunk: list[float]  # bytes one microbatch saves in each model chunk
    logits: float  # one fp32 ``b·s·V/tp`` buffer of the loss (``b·s``: one chunk's tokens when chunked)
    lora: LoraConfig | None = None
    layer_weights: float = 0.0  # bytes a layer saves whatever the tokens: LoRA's frozen bf16 weight copies
    head: float = 0.0  # per token, the final norm and lm_head input a microbatch leaves on the last stage
    head_weights: float = 0.0  # the lm_head's frozen bf16 copy, per microbatch on the last stage
    chunked: bool = False  # the loss runs a chunk of tokens at a time
    output_cache: float = 0.0  # per token, a pipeline's last stage output, where nothing else keeps it
    attention_work: float = 0.0  # per token, the attention path's tensors during a layer's backward
    inputs: float = 16.0  # per token, the first stage's int64 ids and labels (and cp's position and document ids)

    @property
    def first(self) -> bool:
        return 0 in self.ids

    @property
    def last(self) -> bool:
        return self.n_stages - 1 in self.ids

    @property
    def loss_now(self) -> float:
        """Loss buffers at the start of a microbatch's backward: log-softmax output, incoming and
        outgoing gradient (``loss_parallel`` under tp keeps the logits as a fourth)."""
        return (3 + (self.tp > 1)) * self.logits

    def held(self, n_live: int) -> tuple[float, float, float]:
        """(activations, loss, pipeline buffers) with ``n_live`` chunks in flight."""
        st, tokens, v = self.st, self.tokens, len(self.ids)
        h, seq = self.shape.hidden_size, self.tp if self.sp else 1
        acts = n_live * sum(self.chunk) / v + (tokens * self.inputs if self.first else 0)
        n_last = (n_live if v == 1 else min(n_live, 1)) if self.last else 0  # microbatches in the last stage
        # per microbatch: the last layer's output, the final norm and the lm_head input; a
        # pipeline stage's forward cache keeps every in-flight output (the final norm's, on the
        # last stage)
        acts += n_last * tokens * (h * st.resid / seq + self.head) + n_last * self.head_weights
        acts += n_last * tokens * self.output_cache if self.pp > 1 else 0
        loss = 0.0
        if self.last:  # and other in-flight microbatches' saved log-softmax, unless chunked
            loss = self.loss_now + (0 if self.chunked else max(n_last - 1, 0) * self.logits)
        pipe = 0.0
        if self.pp > 1:
            receive = sum(1 for sid in self.ids if sid > 0) + sum(1 for sid in self.ids if sid < self.n_stages - 1)
            pipe = receive * self.num_microbatches * self.boundary
            pipe += n_live * self.boundary if not (self.last and v == 1) else 0  # forward cache of stage outputs
        return acts, loss, pipe


def _rank_activations(
    shape: ModelShape,
    st: StateBytes,
    tp: int,
    sp: bool,
    pp: int,
    recompute: int,
    tokens: int,
    num_microbatches: int,
    layers: list[int],
    ids: list[int],
    n_stages: int,
    lora: LoraConfig | None = None,
    *,
    seq_len: int,
    path: str = "flash",
    cp: int = 1,
    documents: bool = False,
) -> _RankActivations:
    """The activation sizes of the rank holding the stages ``ids`` for microbatches of ``tokens``
    tokens (its ``seq_len / cp`` of sequences of ``seq_len``, attention ``path``, rows packed from
    ``documents`` or not): per model chunk, the saved tensors of
    its layers (a checkpointed layer keeps its input only) and the attention mask, less the
    chunk's input when a receive buffer holds it (every stage but the first)."""
    h, seq = shape.hidden_size, tp if sp else 1
    attention = attention_bytes(shape, tp, seq_len, st, path, cp, documents, rows=tokens * cp // seq_len)
    per_layer = sum(layer_activation_bytes(shape, tp, sp, st, lora).values()) + attention["layer"]
    boundary = tokens * h * st.resid / seq
    logits, chunked = logits_bytes(shape, tp, tokens)
    head, layer_weights, head_weights, head_trained = norm_bytes(h, tp, sp, st), 0.0, 0.0, True
    if lora is not None:
        head_trained = "lm_head" in trained_in_full(shape, lora)
        head = norm_bytes(h, tp, sp, st, int(head_trained), frozen=True)
        if st.autocast:  # torch's autocast caches only weights that require grad
            layer_weights = frozen_layer_matrices(shape, tp) * st.cast_cache
            head_weights = (not head_trained) * shape.vocab_size // tp * h * st.cast_cache
    if chunked:  # the chunks keep the fp32 final-norm output (whole under SP), no lm_head weight copy
        head, head_weights = norm_bytes(h, tp, sp, st, 0, frozen=lora is not None) + h * st.resid, 0.0
    # the final norm's output is what the lm_head or the chunks keep, but under SP (they keep its
    # gathered copy) or where the lm_head keeps no fp32 input (autocast's bf16 copy, a frozen head)
    kept = not sp and (chunked or (head_trained and not st.autocast))
    chunk = []
    for sid in ids:
        n = layers[sid]
        saved = sum(1 for j in range(n) if not (recompute and j % recompute == 0))
        chunk.append(
            tokens * (saved * per_layer + (n - saved) * h * st.resid / seq + attention["mask"])
            - (boundary if sid else 0)
            + saved * layer_weights
        )
    return _RankActivations(
        shape=shape,
        st=st,
        tp=tp,
        sp=sp,
        pp=pp,
        num_microbatches=num_microbatches,
        ids=ids,
        n_stages=n_stages,
        tokens=tokens,
        per_layer=per_layer,
        boundary=boundary,
        chunk=chunk,
        logits=logits,
        lora=lora,
        layer_weights=layer_weights,
        head=head,
        head_weights=head_weights,
        chunked=chunked,
        output_cache=0.0 if kept else h * st.resid / seq,
        attention_work=attention["work"],
        inputs=16.0 + (8.0 + 8.0 * cp) * (cp > 1),  # cp: local position ids, the whole rows' document ids
    )


def _backward_phases(
    rank: _RankActivations, states: dict, *, schedule: str, recompute: int, grad_accum: int, pp_rank: int
) -> list[StageMemory]:
    """The rank's memory at the start of a microbatch's backward (its first of the step, and on a
    pipeline a later one, once the grads exist) and at the end of the step's last backward."""
    st, tokens, v = rank.st, rank.tokens, len(rank.ids)
    live = inflight_chunks(schedule, rank.pp, pp_rank, rank.num_microbatches, v)
    # After a stage's first backward of a step its grads exist; 1F1B then refills the pipeline
    # to ``live`` microbatches, GPipe (and a pipeline with m == live) only drains it.
    live_after = live if schedule != "gpipe" and rank.num_microbatches * v > live else live - 1
    # A layer's backward: at the MLP's product rule the gate, up and silu outputs, the incoming
    # gradient and two outgoing ones are live: 2·b·s·i/tp beyond what the layer saved. A
    # recomputed layer rebuilds its saved tensors first. The loss buffers are gone by then.
    layer_work = tokens * (2 * rank.shape.intermediate_size / rank.tp * st.act + (rank.per_layer if recompute else 0))
    layer_work += rank.layer_weights if recompute else 0
    layer_work += tokens * rank.attention_work
    all_grads = states["trainable_numel"] * st.grad
    h = rank.shape.hidden_size
    head_grads = (rank.shape.vocab_size // rank.tp * h + h) * st.grad if rank.last else 0
    if rank.lora is not None:  # the final norm is frozen; the lm_head's grads exist if it is trained
        trained = rank.last and "lm_head" in trained_in_full(rank.shape, rank.lora)
        head_grads = trained * rank.shape.vocab_size // rank.tp * h * st.grad
    phases = []
    for n_live, grads, label in (
        (live, all_grads if grad_accum > 1 else head_grads, "backward"),
        (live_after, all_grads, "backward-later"),
    ):
        if label == "backward-later" and (rank.pp == 1 or n_live < 1):
            continue
        acts, loss, pipe = rank.held(n_live)
        transient = max(0.0, layer_work - (rank.loss_now if rank.last else 0))
        phases.append(
            StageMemory(
                **states,
                grads=grads,
                activations=acts,
                loss=loss,
                pipeline_buffers=pipe,
                transient=transient,
                phase=label,
            )
        )
    # end of backward: nearly all grads, the first layer's saved tensors and its backward's work
    phases.append(
        StageMemory(
            **states,
            grads=all_grads,
            activations=tokens * rank.per_layer * (not recompute) + rank.layer_weights * (not recompute),
            pipeline_buffers=rank.held(0)[2],
            transient=layer_work,
            phase="backward-end",
        )
    )
    return phases


@lru_cache(maxsize=4096)
def _grad_bucket(sizes: tuple[tuple[int, bool], ...], grad_bytes: int) -> int:
    """``max_bucket`` of the gradients of parameters of ``sizes`` (numel, is_matrix)."""
    return max_bucket([n * grad_bytes for n, _ in sizes])


def _step_phase(
    rank: _RankActivations, states: dict, sizes: tuple[tuple[int, bool], ...], largest: int, dp: int
) -> StageMemory:
    """The rank's memory at the gradient reduction and optimizer step: all grads, and the larger
    of the all-reduce's buckets and AdamW's temporaries."""
    st = rank.st
    bucket = _grad_bucket(sizes, st.grad) if dp > 1 else 0
    opt_tmp = 2 * largest * 4  # AdamW's denominator: sqrt(), then a division, in fp32
    return StageMemory(
        **states,
        grads=states["trainable_numel"] * st.grad,
        pipeline_buffers=rank.held(0)[2],
        comm_buffers=max(bucket, opt_tmp),
        phase="step",
    )


def stage_memory(
    shape: ModelShape,
    *,
    tp: int,
    pp: int,
    dp: int,
    zero_1: bool,
    sp: bool,
    recompute: int,
    micro_batch: int,
    seq_len: int,
    num_microbatches: int,
    grad_accum: int,
    schedule: str,
    virtual_stages: int,
    precision: str,
    pp_rank: int,
    layers: list[int],
    dp_rank: int | None = None,
    lora: LoraConfig | None = None,
    device: str = "cpu",
    documents: bool = False,
    cp: int = 1,
    objective: str = "sft",
) -> StageMemory:
    """Peak tensor bytes on pp rank ``pp_rank`` (dp rank ``dp_rank``; default the most loaded).

    ``micro_batch`` is the pipeline microbatch (sequences per stage forward), ``layers`` the
    layer count of every stage (``pp × virtual_stages`` entries), ``recompute`` the engine's
    every-k-th-layer checkpointing (0 = off), ``lora`` the adapters trained on a frozen base
    (None: full fine-tuning); ``device`` and ``documents`` (rows packed from documents) choose
    the attention path (``attention.attention_path``). Under context parallelism (``cp`` > 1)
    the rank holds ``seq_len / cp`` tokens of each sequence, and the dp × cp ranks reduce the
    gradients and share the ZeRO-1 state (``dp_rank`` is then the rank's place among them,
    ``dp_rank · cp + cp_rank``). ``objective`` (``train.objective``): DPO under LoRA adds the
    reference forward's moment and buffers (``neuron_parallel.planning.reference``)."""
    st = STATES[precision]
    n_stages, ids = pp * virtual_stages, [pp_rank + c * pp for c in range(virtual_stages)]
    replicas = dp * cp
    sizes, states, largest = _rank_parameters(
        shape,
        st,
        tp=tp,
        dp=replicas,
        zero_1=zero_1,
        layers=layers,
        ids=ids,
        n_stages=n_stages,
        dp_rank=dp_rank,
        lora=lora,
    )
    tokens = micro_batch * seq_len // cp
    path = attention_path(device, documents, seq_len, shape.head_dim, cp)
    args = (shape, st, tp, sp, pp, recompute, tokens, num_microbatches, layers, ids, n_stages, lora)
    rank = _rank_activations(*args, seq_len=seq_len, path=path, cp=cp, documents=documents)
    phases = _backward_phases(
        rank, states, schedule=schedule, recompute=recompute, grad_accum=grad_accum, pp_rank=pp_rank
    )
    phases.append(_step_phase(rank, states, sizes, largest, replicas))
    if reference_forward(objective, lora):
        fields, buffers = reference_memory(rank, grads=states["trainable_numel"] * st.grad, grad_accum=grad_accum)
        for phase in phases:
            phase.pipeline_buffers += buffers
        phases.append(StageMemory(**states, **fields))
    if replicas > 1:  # GradReducer's flat buckets, kept from step to step; the step's grads are views into them
        for phase in phases:
            phase.comm_buffers += states["trainable_numel"] * st.grad * (phase.phase != "step")
    return max(phases, key=lambda mem: mem.total)


def layout_memory(
    shape: ModelShape,
    layout,
    layers: list[int],
    *,
    micro_batch_size: int,
    seq_len: int,
    grad_accum: int,
    precision: str,
    pp_rank: int,
    dp_rank: int | None = None,
    lora: LoraConfig | None = None,
    device: str = "cpu",
    documents: bool = False,
    objective: str = "sft",
) -> StageMemory:
    """``stage_memory`` of a layout with ``ParallelConfig``'s field names (a ``ParallelConfig``, the
    planner's ``Candidate``): its ``micro_batch_size`` sequences per dp rank and forward/backward
    split into its ``num_microbatches`` pipeline microbatches (one without a pipeline), its
    ``cp``; ``lora``, ``device``, ``documents`` and ``objective`` as in ``stage_memory``."""
    m = layout.num_microbatches if layout.pp > 1 else 1
    return stage_memory(
        shape,
        tp=layout.tp,
        pp=layout.pp,
        dp=layout.dp,
        zero_1=layout.zero_1,
        sp=layout.sequence_parallel,
        recompute=layout.activation_checkpointing,
        micro_batch=micro_batch_size // m,
        seq_len=seq_len,
        num_microbatches=m,
        grad_accum=grad_accum,
        schedule=layout.pipeline_schedule,
        virtual_stages=layout.virtual_stages,
        precision=precision,
        pp_rank=pp_rank,
        layers=layers,
        dp_rank=dp_rank,
        lora=lora,
        device=device,
        documents=documents,
        cp=layout.cp,
        objective=objective,
    )


def job_rank_memory(shape: ModelShape, job, rank: int) -> StageMemory:
    """The model above for global rank ``rank`` of an engine job (``neuron_parallel.config.JobConfig``):
    its pp coordinate and place among the dp × cp ranks (the mesh is (dp, cp, pp, tp), tp
    innermost), the job's layer split, microbatching and precision (the engine's bf16 mode keeps
    fp32 states, ``bf16_autocast``), ``train.lora``'s adapters if any, its objective (the
    reference forward of DPO under LoRA) and the attention path of its device and data (rows
    packed from documents or not)."""
    pc = job.parallel
    dp_rank, rest = divmod(rank, pc.pp * pc.tp)  # dp_rank · cp + cp_rank: the ZeRO-1 shard's owner
    layers = [len(r) for r in split_layers(shape.num_layers, pc.num_stages, pc.layer_split)]
    precision = "fp32" if pc.mixed_precision == "fp32" else "bf16_autocast"
    kw = dict(micro_batch_size=job.train.micro_batch_size, seq_len=job.block_size, grad_accum=job.grad_accum)
    kw.update(device=job.device, documents=job.data.documents, objective=job.train.objective)
    return layout_memory(
        shape, pc, layers, **kw, precision=precision, pp_rank=rest // pc.tp, dp_rank=dp_rank, lora=job.train.lora
    )
