"""Choosing a parallel layout: every (tp, pp, dp, ZeRO-1, SP, recompute, microbatching) split
of a job, its predicted memory per rank and tokens/s, ranked; and for every rejected split, why.

    search = search_layouts("path/to/config.json", "trn2.48xlarge", nodes=2, seq_len=4096, global_batch=256)
    search.feasible, search.best.to_parallel_config(), search.candidates[0].tokens_per_s

Memory per rank: ``neuron_parallel.planning.memory`` (tensor bytes of the worst pp rank, plus the
hardware's allocator margin and runtime reserve). A layout fits when that is at most
``memory_fraction`` (``launch.memory_fraction``, default 0.9) of the rank's memory: the rest is
headroom for what the model misses. ``lora`` plans adapters on a frozen base
(``neuron_parallel.planning.lora``) instead of full fine-tuning. Step time, per optimizer step:

* compute: training FLOPs per token as in the PaLM paper's MFU (Chowdhery et al. 2022, appendix
  B: ``6N + 12·L·H·Q·T``; a recomputed layer adds its forward, a third of its training FLOPs;
  under LoRA a frozen weight costs ``4N``, no weight gradient) at ``peak × efficiency`` of the
  hardware kind, the peak of the precision run (``HardwareSpec.peak_flops``: fp32 matmuls for
  ``fp32``, bf16 for ``bf16`` and ``bf16_autocast``), which is also the MFU denominator;
* tensor parallelism: per layer and microbatch 4 collectives of ``b·s·h`` elements (6 with
  recompute; 2 more on a stage holding the embedding or the lm_head), ring cost ``2(t-1)/t``, on
  the node's links (TP never leaves a node);
* pipeline: ``(m + (p-1)/v)`` microbatch slots of the slowest stage (bubble ``(p-1)/(m+p-1)``,
  interleaved ``(p-1)/(v·m)``), plus the boundary sends; the network when a pp group spans nodes;
* data parallelism: a ring all-reduce ``2(d-1)/d`` of the gradient bytes (ZeRO-1 adds the
  updated parameters' broadcast, ``(d-1)/d``), counted in full after the step's compute: the
  engine's reducer (``neuron_parallel.parallel.data_parallel.GradReducer``) starts each bucket's
  all-reduce while the last micro-batch's backward runs, an overlap this model does not credit;
  across nodes each node's network carries one ring per co-located replica.

Candidates: every tp dividing the world (TP within a node), every pp dividing the rest, ZeRO-1
on/off (dp > 1), SP on/off (tp > 1, sequence divisible by tp), recompute off/every layer,
pipeline microbatches of b ∈ {1, 2, 4, 8} sequences, and with pp > 1 the 1F1B, interleaved 1F1B
(v = 2) and GPipe schedules with m ∈ {p, 2p, all the rank's sequences} microbatches per engine
step (the zero-bubble V schedule is not modelled). Nothing here imports torch: planning a 70B
model on 1024 ranks (about 5,600 candidates) takes one to two seconds.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from ..config import LAYOUT_FIELDS, LaunchConfig, LoraConfig, ParallelConfig
from ..utils import divisors, split_layers
from .attention import block_size_advice
from .hardware import HardwareSpec, get_hardware
from .layout import describe_layout, tp_problems
from .lora import adapter_params, describe_lora, lora_flops_per_token, trainable_parameters, trained_in_full
from .memory import STATES, GiB, ModelShape, layout_memory, model_states_bytes

SCHEDULES = ("1f1b", "interleaved_1f1b", "gpipe")
MICRO_BATCHES = (1, 2, 4, 8)
MEMORY_FRACTION = next(f.default for f in dataclasses.fields(LaunchConfig) if f.name == "memory_fraction")
"""The share of a rank's memory a layout may fill unless told otherwise (``launch.memory_fraction``)."""


@dataclass(slots=True)
class Candidate:
    """One layout considered for the job, fitting or not."""

    tp: int
    pp: int
    dp: int
    zero_1: bool = False
    sequence_parallel: bool = False
    num_microbatches: int = 1
    pipeline_schedule: str = "1f1b"
    virtual_stages: int = 1
    activation_checkpointing: int = 0
    micro_batch_size: int = 1
    """Sequences per dp rank per forward/backward (``train.micro_batch_size``)."""
    grad_accum: int = 1
    precision: str = "bf16"
    valid: bool = True
    fits: bool = False
    memory_per_rank_bytes: int | None = None
    memory: dict = field(default_factory=dict)
    tokens_per_s: float | None = None
    mfu: float | None = None
    step_time_s: float | None = None
    time: dict = field(default_factory=dict)
    reason: str | None = None
    notes: list[str] = field(default_factory=list)

    def to_parallel_config(self):
        """This layout as the engine's ``ParallelConfig`` (``mixed_precision`` fp32 for ``fp32``,
        bf16 otherwise; the engine's bf16 keeps fp32 states, which ``bf16_autocast`` plans for).
        The batch split goes to ``TrainConfig(micro_batch_size=..., grad_accum=...)``."""
        layout = {name: getattr(self, name) for name in LAYOUT_FIELDS}
        return ParallelConfig(**layout, dp=self.dp, mixed_precision="fp32" if self.precision == "fp32" else "bf16")

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def describe(self) -> str:
        """This layout and its batch split in one line (``describe_layout``)."""
        return describe_layout(self, micro_batch_size=self.micro_batch_size, grad_accum=self.grad_accum)


@dataclass(slots=True)
class LayoutSearch:
    """Every candidate, best first: fitting ones by predicted tokens/s, then those that do not fit
    (least memory first), then invalid splits."""

    model: ModelShape
    hardware: HardwareSpec
    nodes: int
    seq_len: int
    global_batch: int
    precision: str
    candidates: list[Candidate]
    reason: str | None = None
    lora: LoraConfig | None = None
    memory_fraction: float = MEMORY_FRACTION
    documents: bool = False
    """Rows packed from documents (attention within documents), as planned for."""

    @property
    def memory_limit(self) -> float:
        """Bytes per rank a layout may fill: ``memory_fraction`` of the rank's memory."""
        return self.memory_fraction * self.hardware.memory_per_rank

    @property
    def feasible(self) -> bool:
        return any(c.fits for c in self.candidates)

    @property
    def best(self) -> Candidate | None:
        return self.candidates[0] if self.feasible else None

    @property
    def world_size(self) -> int:
        return self.nodes * self.hardware.ranks_per_node

    def to_dict(self) -> dict:
        trainable = trainable_parameters(self.model, self.lora) if self.lora else self.model.num_parameters
        return {
            "feasible": self.feasible,
            "reason": self.reason,
            "model": dataclasses.asdict(self.model),
            "hardware": dataclasses.asdict(self.hardware),
            "nodes": self.nodes,
            "world_size": self.world_size,
            "seq_len": self.seq_len,
            "global_batch": self.global_batch,
            "precision": self.precision,
            "lora": dataclasses.asdict(self.lora) if self.lora else None,
            "trainable_parameters": trainable,
            "memory_fraction": self.memory_fraction,
            "memory_limit_bytes": int(self.memory_limit),
            "documents": self.documents,
            "candidates": [c.as_dict() for c in self.candidates],
        }


def _tp_problems(shape: ModelShape, tp: int, hw: HardwareSpec, seq_len: int) -> list[str]:
    """Why ``tp`` cannot split this model on this hardware (empty when it can)."""
    out = []
    if tp > hw.ranks_per_node or hw.ranks_per_node % tp:
        out.append(
            f"tp={tp} does not fit within a {hw.name} node of {hw.ranks_per_node} ranks (TP needs the "
            f"node's links); use tp dividing {hw.ranks_per_node}"
        )
    return out + tp_problems(shape, tp)


def _options(shape: ModelShape, tp: int, pp: int, dp: int, batch: int, seq_len: int, fixed: dict):
    """Every (zero_1, sp, recompute, schedule, v, m, b, accum) for a valid (tp, pp, dp); a value in
    ``fixed`` replaces the choices for its field (schedule, v and m only matter when pp > 1)."""
    zeros = [fixed["zero_1"]] if "zero_1" in fixed else ([False, True] if dp > 1 else [False])
    sps = [fixed["sequence_parallel"]] if "sequence_parallel" in fixed else [False, True]
    acs = [fixed["activation_checkpointing"]] if "activation_checkpointing" in fixed else [0, 1]
    scheds = [fixed["pipeline_schedule"]] if "pipeline_schedule" in fixed else SCHEDULES
    for zero in zeros:
        for sp in sps:
            if sp and (tp == 1 or seq_len % tp):
                continue
            for ac in acs:
                pinned = fixed.get("micro_batch_size")
                for b in (b for b in (divisors(pinned) if pinned else MICRO_BATCHES) if batch % b == 0):
                    total = batch // b
                    if pp == 1:
                        if pinned in (None, b):
                            yield zero, sp, ac, "1f1b", 1, 1, b, total
                        continue
                    for sched in scheds:
                        v = fixed.get("virtual_stages", 2 if sched == "interleaved_1f1b" else 1)
                        if pp * v > shape.num_layers or (v > 1) != (sched == "interleaved_1f1b"):
                            continue
                        ms = [fixed["num_microbatches"]] if "num_microbatches" in fixed else sorted({pp, 2 * pp, total})
                        for m in ms:
                            if m > total or total % m or (sched != "gpipe" and m < pp):
                                continue
                            if sched == "interleaved_1f1b" and m % max(1, m // pp):
                                continue  # torch: m must split into rounds of about pp microbatches
                            if pinned not in (None, m * b):
                                continue
                            yield zero, sp, ac, sched, v, m, b, total // m


def _bw_pp_dp(hw: HardwareSpec, tp: int, pp: int, dp: int) -> tuple[float, float]:
    """Effective bandwidth of a pp boundary and of a dp ring (bytes/s per rank)."""
    rpn = hw.ranks_per_node
    bw_pp = hw.intra_node_bw if tp * pp <= rpn else min(hw.intra_node_bw, hw.inter_node_bw / tp)
    if tp * pp * dp <= rpn:
        bw_dp = hw.intra_node_bw
    else:  # every replica co-located on a node drives one ring through the node's network
        bw_dp = min(hw.intra_node_bw, hw.inter_node_bw / min(tp * pp, rpn))
    return bw_pp, bw_dp


def step_time(
    shape: ModelShape, hw: HardwareSpec, c: Candidate, seq_len: int, layers: list[int], lora: LoraConfig | None = None
) -> dict:
    """Seconds per optimizer step, by component (see the module docstring)."""
    st = STATES[c.precision]
    h, tp, pp, v = shape.hidden_size, c.tp, c.pp, c.virtual_stages
    b = c.micro_batch_size // c.num_microbatches
    tokens = b * seq_len
    rate = hw.peak_flops(c.precision) * hw.efficiency
    f_layer = 2 * shape.layer_params + 4 * shape.num_heads * shape.head_dim * seq_len  # forward, per token
    f_head = 2 * shape.vocab_size * h
    f_train, head_passes = 3 * f_layer, 3  # forward, input gradient, weight gradient
    if lora is not None:  # frozen weights: no weight gradient; attention and adapters as before
        f_attn, f_adapter = 4 * shape.num_heads * shape.head_dim * seq_len, 2 * adapter_params(shape, lora)
        f_train = 2 * (f_layer - f_attn) + 3 * (f_attn + f_adapter)
        head_passes = 3 if "lm_head" in trained_in_full(shape, lora) else 2
        f_layer += f_adapter  # what a recomputed layer re-runs
    ring = 2 * (tp - 1) / tp if tp > 1 else 0
    bw_pp, bw_dp = _bw_pp_dp(hw, tp, pp, c.dp)
    n_stages = pp * v
    worst = comm_worst = 0.0
    for r in range(pp):
        compute = comm = 0.0
        for sid in range(r, n_stages, pp):
            n = layers[sid]
            rc = sum(1 for j in range(n) if c.activation_checkpointing and j % c.activation_checkpointing == 0)
            head = head_passes * f_head if sid == n_stages - 1 else 0
            compute += tokens * (f_train * n + f_layer * rc + head) / tp / rate
            comm += (4 * n + 2 * rc + 2 * (sid in (0, n_stages - 1))) * ring * tokens * h * st.resid / hw.intra_node_bw
        if compute + comm > worst + comm_worst:
            worst, comm_worst = compute, comm
    p2p = 2 * tokens * h * st.resid / (tp if c.sequence_parallel else 1) / bw_pp if pp > 1 else 0.0
    t_mb = worst + comm_worst + p2p
    slots = c.num_microbatches + (pp - 1) / v
    grad_bytes = c.memory["trainable_numel"] * st.grad
    ring_dp = 2 * (c.dp - 1) / c.dp
    dp_s = (ring_dp * grad_bytes + (c.dp - 1) / c.dp * grad_bytes * st.param / st.grad * c.zero_1) / bw_dp
    return {
        "compute_s": c.grad_accum * c.num_microbatches * worst,
        "tp_comm_s": c.grad_accum * c.num_microbatches * comm_worst,
        "pp_p2p_s": c.grad_accum * c.num_microbatches * p2p,
        "pp_bubble_s": c.grad_accum * (pp - 1) / v * t_mb,
        "dp_comm_s": dp_s if c.dp > 1 else 0.0,
        "total_s": c.grad_accum * slots * t_mb + (dp_s if c.dp > 1 else 0.0),
    }


def _evaluate(
    shape: ModelShape,
    hw: HardwareSpec,
    c: Candidate,
    seq_len: int,
    global_batch: int,
    lora: LoraConfig | None,
    memory_fraction: float,
    documents: bool = False,
) -> None:
    """Fill in ``c``'s memory, whether it fits ``memory_fraction`` of a rank, its step time, and
    when it does not fit, the reason and what would help."""
    layers = [len(r) for r in split_layers(shape.num_layers, c.pp * c.virtual_stages)]
    kw = dict(micro_batch_size=c.micro_batch_size, seq_len=seq_len, grad_accum=c.grad_accum, precision=c.precision)
    kw.update(lora=lora, device=hw.device, documents=documents)
    # rank 0 holds the embedding and the most in-flight microbatches, rank p-1 the lm_head and
    # loss; the ranks between hold no more than rank 0
    worst = max((layout_memory(shape, c, layers, pp_rank=r, **kw) for r in {0, c.pp - 1}), key=lambda m: m.total)
    tensors = worst.total
    margin = tensors * hw.allocator_margin
    total = tensors + margin + hw.reserved_bytes
    c.memory = {
        **worst.as_dict(),
        "tensors": int(tensors),
        "allocator_margin": int(margin),
        "runtime_reserved": hw.reserved_bytes,
        "total": int(total),
    }
    c.memory_per_rank_bytes = int(total)
    limit = memory_fraction * hw.memory_per_rank
    c.fits = total <= limit
    c.time = step_time(shape, hw, c, seq_len, layers, lora)
    c.step_time_s = c.time["total_s"]
    c.tokens_per_s = global_batch * seq_len / c.step_time_s
    world = c.tp * c.pp * c.dp
    flops = lora_flops_per_token(shape, lora, seq_len) if lora else shape.flops_per_token(seq_len)
    c.mfu = c.tokens_per_s * flops / (world * hw.peak_flops(c.precision))
    if c.tp > shape.num_kv_heads:
        c.notes.append(f"KV heads replicated {c.tp // shape.num_kv_heads}x (tp={c.tp} > {shape.num_kv_heads} KV heads)")
    if not c.fits:
        big = max(
            ("params", "grads", "optimizer", "activations", "loss", "pipeline_buffers"),
            key=lambda k: worst.as_dict()[k],
        )
        if big in ("activations", "loss", "pipeline_buffers"):
            hint = "recompute, sequence parallelism, a smaller micro batch or fewer microbatches in flight"
        else:
            hint = (
                "more model parallelism (tp × pp)"
                + (", ZeRO-1" if c.dp > 1 and not c.zero_1 else "")
                + (", LoRA (train.lora)" if lora is None else "")
                + " or more nodes"
            )
        if total <= hw.memory_per_rank:
            hint += (
                f", or a memory_fraction of at least {math.ceil(100 * total / hw.memory_per_rank) / 100:.2f} "
                "(launch.memory_fraction, --memory-fraction) if you accept less headroom"
            )
        share = (
            f", of which a layout may fill {memory_fraction * 100:g}% ({limit / GiB:.2f} GiB, memory_fraction="
            f"{memory_fraction:g})"
            if memory_fraction < 1
            else ""
        )
        c.reason = (
            f"needs {total / GiB:.2f} GiB per rank (largest part: {big} {worst.as_dict()[big] / GiB:.1f} GiB) "
            f"but a {hw.name} rank has {hw.memory_per_rank / GiB:.1f} GiB{share}; try {hint}"
        )


def _min_nodes(
    shape: ModelShape, hw: HardwareSpec, precision: str, nodes: int, memory_fraction: float, lora: LoraConfig | None
) -> int | None:
    """Fewest nodes whose ranks could hold the model states alone (a lower bound: activations
    not counted; under LoRA the frozen parameters alone), trying up to 64× the nodes asked for."""
    usable = memory_fraction * hw.memory_per_rank - hw.reserved_bytes
    for n in range(nodes, 64 * nodes + 1):
        world = n * hw.ranks_per_node
        mp = max(t * p for t in divisors(hw.ranks_per_node) for p in divisors(world // t) if p <= shape.num_layers)
        if lora is None:
            need = model_states_bytes(shape.num_parameters / mp, dp=world // mp, zero_1=True, precision=precision)
        else:
            need = shape.num_parameters / mp * STATES[precision].param
        if need * (1 + hw.allocator_margin) <= usable:
            return n
    return None


FIXABLE = LAYOUT_FIELDS + ("micro_batch_size",)
"""What a search can be asked to keep: the layout fields and the micro batch."""


def _check_arguments(
    fixed: dict | None, precision: str, nodes: int, seq_len: int, global_batch: int, memory_fraction: float
) -> dict:
    """``fixed`` as a new dict, once the arguments of ``search_layouts`` are known to make sense
    (a ``ValueError`` saying what is wrong otherwise)."""
    fixed = dict(fixed or {})
    unknown = sorted(set(fixed) - set(FIXABLE))
    if unknown:
        raise ValueError(f"cannot pin {unknown}; the planner's fields are {', '.join(FIXABLE)}")
    if fixed.get("pipeline_schedule") == "zbv":
        raise ValueError(
            "the planner has no model of the zbv schedule; pin pipeline_schedule to 1f1b, "
            "interleaved_1f1b or gpipe, or give the whole layout explicitly"
        )
    if precision not in STATES:
        raise ValueError(f"precision={precision!r} is not one of {sorted(STATES)}")
    if nodes < 1 or seq_len < 1 or global_batch < 1:
        raise ValueError(f"nodes, seq_len and global_batch must be >= 1, got {nodes}, {seq_len}, {global_batch}")
    if not 0 < memory_fraction <= 1:
        raise ValueError(
            f"memory_fraction must lie in (0, 1], got {memory_fraction}; it is the share of a rank's memory a "
            "layout may fill, e.g. 0.9"
        )
    return fixed


def _split_problems(shape: ModelShape, tp_why: list[str], pp: int, dp: int, global_batch: int) -> list[str]:
    """Why a (tp, pp, dp) split cannot run this model and batch: ``tp_why`` (the tp's own
    problems), then pp and batch problems (empty when it can)."""
    why = list(tp_why)
    if pp > shape.num_layers:
        why.append(f"pp={pp} exceeds the model's {shape.num_layers} layers")
    if global_batch % dp:
        why.append(f"global batch {global_batch} is not divisible by dp={dp}")
    elif pp > 1 and global_batch // dp < pp:
        why.append(
            f"{global_batch // dp} sequences per dp rank cannot fill pp={pp} stages (1F1B needs "
            f"num_microbatches >= pp); raise the global batch to {pp * dp} or lower pp"
        )
    return why


def _candidates(
    shape: ModelShape,
    hw: HardwareSpec,
    world: int,
    seq_len: int,
    global_batch: int,
    precision: str,
    fixed: dict,
    lora: LoraConfig | None,
    memory_fraction: float,
    documents: bool = False,
) -> list[Candidate]:
    """Every candidate over (tp, pp) splits of ``world`` ranks that ``fixed`` allows, evaluated;
    an invalid split is one candidate carrying its reason."""
    out: list[Candidate] = []
    for tp in divisors(world):
        if fixed.get("tp", tp) != tp:
            continue
        tp_why = _tp_problems(shape, tp, hw, seq_len)
        for pp in divisors(world // tp):
            if fixed.get("pp", pp) != pp:
                continue
            dp = world // (tp * pp)
            why = _split_problems(shape, tp_why, pp, dp, global_batch)
            if why:
                out.append(Candidate(tp=tp, pp=pp, dp=dp, precision=precision, valid=False, reason="; ".join(why)))
                continue
            for zero, sp, ac, sched, v, m, b, accum in _options(shape, tp, pp, dp, global_batch // dp, seq_len, fixed):
                c = Candidate(
                    tp=tp,
                    pp=pp,
                    dp=dp,
                    zero_1=zero,
                    sequence_parallel=sp,
                    num_microbatches=m,
                    pipeline_schedule=sched,
                    virtual_stages=v,
                    activation_checkpointing=ac,
                    micro_batch_size=m * b,
                    grad_accum=accum,
                    precision=precision,
                )
                _evaluate(shape, hw, c, seq_len, global_batch, lora, memory_fraction, documents)
                out.append(c)
    return out


def _rank_key(c: Candidate) -> tuple:
    """Sort key, best first: fitting candidates by predicted tokens/s, then those that do not fit
    (least memory first), then invalid splits. Equal predicted speed (to 3 digits) prefers the
    larger microbatch: the model has no per-kernel overheads, which favour fewer, larger matmuls
    in practice."""
    return (
        not c.fits,
        not c.valid,
        -float(f"{c.tokens_per_s or 0:.3g}") if c.fits else 0,
        -(c.micro_batch_size // c.num_microbatches) if c.fits else 0,
        c.memory_per_rank_bytes or 0,
    )


def _infeasible_reason(report: LayoutSearch, fixed: dict) -> str:
    """Why none of the ``report``'s candidates (ranked) fits: no candidate at all, no valid split,
    or the smallest layout's memory (and the fewest nodes the model states alone need, when more)."""
    hw, nodes, candidates = report.hardware, report.nodes, report.candidates
    world = nodes * hw.ranks_per_node
    valid = [c for c in candidates if c.valid]
    if not candidates:
        return (
            f"no layout of {world} ranks has {fixed}: tp and pp must divide the world size, "
            "sequence_parallel needs tp > 1; unpin a field (set it to auto)"
        )
    if not valid:
        return f"no split of {world} ranks suits this model and batch: {candidates[0].reason}"
    least = min(valid, key=lambda c: c.memory_per_rank_bytes)
    fraction = report.memory_fraction
    share = f" ({fraction * 100:g}% of its {hw.memory_per_rank / GiB:.1f} GiB, memory_fraction={fraction:g})"
    reason = (
        f"no layout fits {report.memory_limit / GiB:.1f} GiB per {hw.name} rank{share if fraction < 1 else ''}: "
        f"the smallest, {least.describe()}, needs {least.memory_per_rank_bytes / GiB:.1f} GiB"
    )
    n = _min_nodes(report.model, hw, report.precision, nodes, fraction, report.lora)
    if n and n > nodes:
        reason += f"; the model states alone need at least {n} nodes of {hw.name}"
    return reason


def search_layouts(
    model_config,
    hardware: str | HardwareSpec,
    *,
    nodes: int = 1,
    seq_len: int,
    global_batch: int,
    precision: str = "bf16",
    ranks_per_node: int | None = None,
    fixed: dict | None = None,
    lora: LoraConfig | None = None,
    memory_fraction: float = MEMORY_FRACTION,
    documents: bool = False,
) -> LayoutSearch:
    """Every layout of ``global_batch`` sequences of ``seq_len`` tokens of the model described by
    ``model_config`` (config.json path or directory, dict, ``PretrainedConfig``; weights are never
    read) on ``nodes`` nodes of ``hardware`` (a catalog name, YAML path or ``HardwareSpec``),
    ranked best first. ``precision``: ``bf16`` (bf16 params/grads, fp32 master and Adam,
    the ZeRO paper's mixed precision), ``fp32`` (the engine's ``mixed_precision: fp32``, which
    ``auto`` runs on CPU) or ``bf16_autocast`` (the engine's ``mixed_precision: bf16``, which
    ``auto`` runs on cuda and neuron: fp32 states, bf16 autocast); compute runs at that
    precision's peak (``HardwareSpec.peak_flops``).
    ``fixed`` pins fields of ``FIXABLE`` (e.g. ``{"tp": 8, "zero_1": True}``): only layouts with
    those values are considered, and a pinned value is evaluated even where the free search
    would not try it (``activation_checkpointing=2``, ``num_microbatches=6``). ``lora`` plans
    low-rank adapters on the frozen model (None: full fine-tuning); a layout fits when its
    predicted memory per rank is at most ``memory_fraction`` of the rank's memory.
    ``documents``: rows packed from documents, whose attention path on the hardware's device
    (``neuron_parallel.planning.attention``) may hold an explicit mask or fp32 scores."""
    fixed = _check_arguments(fixed, precision, nodes, seq_len, global_batch, memory_fraction)
    shape = ModelShape.from_config(model_config)
    hw = get_hardware(hardware, ranks_per_node)
    world = nodes * hw.ranks_per_node
    args = (shape, hw, world, seq_len, global_batch, precision, fixed, lora, memory_fraction, documents)
    candidates = sorted(_candidates(*args), key=_rank_key)
    report = LayoutSearch(
        shape, hw, nodes, seq_len, global_batch, precision, candidates, lora=lora, memory_fraction=memory_fraction
    )
    report.documents = documents
    if not report.feasible:
        report.reason = _infeasible_reason(report, fixed)
    return report


def format_table(report: LayoutSearch, limit: int = 10) -> str:
    """The best ``limit`` layouts and a sample of rejected ones, as text."""
    hw = report.hardware
    n = report.model.num_parameters
    size = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"
    training = describe_lora(report.lora)
    if report.lora:
        trained = trainable_parameters(report.model, report.lora)
        training += f", {trained / 1e6:.1f}M trainable"
    lines = [
        f"{report.model.name or 'model'}: {size} params on {report.nodes} × "
        f"{hw.name} ({report.world_size} ranks, {hw.memory_per_rank / GiB:.1f} GiB each), seq {report.seq_len}, "
        f"global batch {report.global_batch}, {report.precision}, {training}",
        f"fits within {report.memory_fraction * 100:g}% of {hw.memory_per_rank / GiB:.1f} GiB = "
        f"{report.memory_limit / GiB:.1f} GiB per rank (memory_fraction)",
    ]
    if hw.planning_only:
        lines.append(f"note: {hw.name} is for planning only ({hw.source})")
    advice = block_size_advice(hw.device, report.documents, report.seq_len, report.model.head_dim)
    if advice:
        lines.append(f"note: {advice}")
    fitting = [c for c in report.candidates if c.fits][:limit]
    lines.append(f"{'layout':58s} {'GiB/rank':>8s} {'tokens/s':>10s} {'MFU':>5s}")
    for c in fitting:
        lines.append(
            f"{c.describe():58s} {c.memory_per_rank_bytes / GiB:8.2f} {c.tokens_per_s:10.0f} {c.mfu:5.1%}"
            + (f"  ({'; '.join(c.notes)})" if c.notes else "")
        )
    rejected = [c for c in report.candidates if not c.fits]
    if rejected:
        lines.append(f"rejected {len(rejected)} of {len(report.candidates)}, e.g.:")
        seen = set()
        for c in rejected:  # one per (tp, pp), the closest to fitting first
            if (c.tp, c.pp) not in seen and len(seen) < 6:
                seen.add((c.tp, c.pp))
                lines.append(f"  {c.describe()}: {c.reason}")
    lines.append(f"feasible: {report.feasible}" + (f" — {report.reason}" if report.reason else ""))
    return "\n".join(lines)
