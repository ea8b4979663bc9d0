"""Choosing a parallel layout: every (tp, pp, cp, dp, ZeRO-1, SP, recompute, microbatching) split
of a job, its predicted memory per rank and tokens/s, ranked; and for every rejected split, why.

    search = search_layouts("path/to/config.json", "trn2.48xlarge", nodes=2, seq_len=4096, global_batch=256)
    search.feasible, search.best.to_parallel_config(), search.candidates[0].tokens_per_s

Memory per rank: ``neuron_parallel.planning.memory`` (tensor bytes of the worst pp rank, plus the
hardware's allocator margin and runtime reserve). A layout fits when that is at most
``memory_fraction`` (``launch.memory_fraction``, default 0.9) of the rank's memory: the rest is
headroom for what the model misses. ``lora`` plans adapters on a frozen base
(``neuron_parallel.planning.lora``) instead of full fine-tuning. Step time, per optimizer step:
``neuron_parallel.planning.timing`` (compute, and the tp, cp, pp and dp communication). Under
``objective`` dpo with ``lora`` each micro-batch also runs the base's forward for the reference,
in time and memory (``neuron_parallel.planning.reference``).

Candidates: every tp dividing the world (TP within a node), every cp dividing the rest whose
``2·cp`` chunks divide the sequence (``layout.context_problem``) and keep ``MIN_CONTEXT_CHUNK``
tokens, every pp dividing the rest, ZeRO-1 on/off (dp × cp > 1), SP on/off (tp > 1, the rank's
``S/cp`` tokens divisible by tp), recompute off/every layer, pipeline microbatches of
b ∈ {1, 2, 4, 8} sequences (under cp, fewer than cp: see ``_options``), and with pp > 1 the
1F1B, interleaved 1F1B (v = 2) and GPipe schedules with m ∈ {p, 2p, all the rank's sequences}
microbatches per engine step (the zero-bubble V schedule is not modelled). Nothing here imports
torch: planning a 70B model on 1024 ranks at 8192 tokens (about 16,000 candidates) takes about
two seconds.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from ..config import LAYOUT_FIELDS, LaunchConfig, LoraConfig, ParallelConfig
from ..utils import CONTEXT_QUERY_BLOCK, divisors, split_layers
from .attention import attention_path, block_size_advice
from .hardware import HardwareSpec, get_hardware
from .layout import context_problem, describe_layout, tp_problems
from .lora import describe_lora, lora_flops_per_token, trainable_parameters
from .memory import STATES, GiB, ModelShape, layout_memory, model_states_bytes
from .reference import reference_forward, reference_seconds
from .timing import step_time

SCHEDULES = ("1f1b", "interleaved_1f1b", "gpipe")
MICRO_BATCHES = (1, 2, 4, 8)
MIN_CONTEXT_CHUNK = 512
"""The shortest of a row's ``2·cp`` chunks the free search plans for (a pinned cp is evaluated
whatever its chunks): shorter chunks make each rank's attention too thin a slice to run near the
peak (torch-neuronx's flash kernel works in tiles of 512 positions, FlexAttention in blocks of
128), and they cut the search down to the cp degrees long rows need."""
MEMORY_FRACTION = next(f.default for f in dataclasses.fields(LaunchConfig) if f.name == "memory_fraction")
"""The share of a rank's memory a layout may fill unless told otherwise (``launch.memory_fraction``)."""


@dataclass(slots=True)
class Candidate:
    """One layout considered for the job, fitting or not."""

    tp: int
    pp: int
    dp: int
    cp: int = 1
    """Context-parallel degree: each rank holds ``seq_len / cp`` tokens of every sequence."""
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
    objective: str = "sft"
    """The training objective planned for (``train.objective``)."""

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
            "objective": self.objective,
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


def _options(shape: ModelShape, tp: int, pp: int, cp: int, dp: int, batch: int, seq_len: int, fixed: dict):
    """Every (zero_1, sp, recompute, schedule, v, m, b, accum) for a valid (tp, pp, cp, dp); a value
    in ``fixed`` replaces the choices for its field (schedule, v and m only matter when pp > 1).

    Under cp > 1 a microbatch of ``b`` sequences, ``b`` a multiple of cp, is left out: each rank
    then holds ``b/cp`` sequences' worth of tokens, the work, memory and gradient reduction of the
    layout with cp = 1 on the dp × cp ranks and microbatches of ``b/cp`` sequences, without the
    K/V exchange, so never better. Kept where that layout is not searched (cp or the micro batch
    pinned, or too few sequences per rank for the pipeline)."""
    shadowed = cp > 1 and not {"cp", "micro_batch_size"} & set(fixed) and (pp == 1 or batch // cp >= pp)
    zeros = [fixed["zero_1"]] if "zero_1" in fixed else ([False, True] if dp * cp > 1 else [False])
    sps = [fixed["sequence_parallel"]] if "sequence_parallel" in fixed else [False, True]
    acs = [fixed["activation_checkpointing"]] if "activation_checkpointing" in fixed else [0, 1]
    scheds = [fixed["pipeline_schedule"]] if "pipeline_schedule" in fixed else SCHEDULES
    for zero in zeros:
        for sp in sps:
            if sp and (tp == 1 or seq_len // cp % tp):
                continue
            for ac in acs:
                pinned = fixed.get("micro_batch_size")
                for b in (b for b in (divisors(pinned) if pinned else MICRO_BATCHES) if batch % b == 0):
                    if shadowed and b % cp == 0:
                        continue
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


def _evaluate(
    shape: ModelShape,
    hw: HardwareSpec,
    c: Candidate,
    seq_len: int,
    global_batch: int,
    lora: LoraConfig | None,
    memory_fraction: float,
    documents: bool = False,
    objective: str = "sft",
) -> None:
    """Fill in ``c``'s memory, whether it fits ``memory_fraction`` of a rank, its step time, and
    when it does not fit, the reason and what would help."""
    layers = [len(r) for r in split_layers(shape.num_layers, c.pp * c.virtual_stages)]
    kw = dict(micro_batch_size=c.micro_batch_size, seq_len=seq_len, grad_accum=c.grad_accum, precision=c.precision)
    kw.update(lora=lora, device=hw.device, documents=documents, objective=objective)
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
    c.time = step_time(shape, hw, c, seq_len, layers, lora, documents)
    if reference_forward(objective, lora):
        c.time["reference_s"] = reference_seconds(shape, hw, c, seq_len, layers, documents)
        c.time["total_s"] += c.time["reference_s"]
    c.step_time_s = c.time["total_s"]
    c.tokens_per_s = global_batch * seq_len / c.step_time_s
    world = c.tp * c.pp * c.cp * c.dp
    flops = lora_flops_per_token(shape, lora, seq_len) if lora else shape.flops_per_token(seq_len)
    c.mfu = c.tokens_per_s * flops / (world * hw.peak_flops(c.precision))
    if c.tp > shape.num_kv_heads:
        c.notes.append(f"KV heads replicated {c.tp // shape.num_kv_heads}x (tp={c.tp} > {shape.num_kv_heads} KV heads)")
    if not c.fits:
        parts = worst.as_dict()
        big = max(
            ("params", "grads", "optimizer", "activations", "loss", "pipeline_buffers", "transient"),
            key=lambda k: parts[k],
        )
        if big == "transient" and attention_path(hw.device, documents, seq_len, shape.head_dim, c.cp) == "scores":
            hint = (
                "fewer attention scores per rank: on this path every layer builds fp32 (heads/tp)·S·S scores "
                "(neuron's attention with a mask) and a recomputed layer's backward holds three such tensors; "
                "more tp, context parallelism (parallel.cp: its attention builds the scores of "
                f"{CONTEXT_QUERY_BLOCK} queries at a time), a shorter data.block_size, or rows its flash kernel runs"
            )
        elif big in ("activations", "loss", "pipeline_buffers", "transient"):
            hint = (
                "recompute, sequence parallelism, context parallelism (parallel.cp), a smaller micro batch or "
                "fewer microbatches in flight"
            )
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
            f"needs {total / GiB:.2f} GiB per rank (largest part: {big} {parts[big] / GiB:.1f} GiB) "
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
    objective: str = "sft",
) -> list[Candidate]:
    """Every candidate over (tp, cp, pp) splits of ``world`` ranks that ``fixed`` allows,
    evaluated; an invalid split is one candidate carrying its reason."""
    out: list[Candidate] = []
    tp_why = {tp: _tp_problems(shape, tp, hw, seq_len) for tp in divisors(world) if fixed.get("tp", tp) == tp}

    def searched(tp: int, cp: int) -> bool:  # a free cp > 1 only on a valid tp and chunks of MIN_CONTEXT_CHUNK
        if "cp" in fixed:
            return fixed["cp"] == cp
        return cp == 1 or (not tp_why[tp] and seq_len // (2 * cp) >= MIN_CONTEXT_CHUNK)

    splits = [
        (tp, cp, pp)
        for tp in tp_why
        for cp in divisors(world // tp)
        if searched(tp, cp)
        for pp in divisors(world // (tp * cp))
        if fixed.get("pp", pp) == pp
    ]
    for tp, cp, pp in splits:
        dp = world // (tp * cp * pp)
        why = _split_problems(shape, tp_why[tp], pp, dp, global_batch)
        why += [problem] if (problem := context_problem(cp, seq_len)) else []
        if why:
            reason = "; ".join(why)
            out.append(Candidate(tp=tp, pp=pp, dp=dp, cp=cp, precision=precision, valid=False, reason=reason))
            continue
        for zero, sp, ac, sched, v, m, b, accum in _options(shape, tp, pp, cp, dp, global_batch // dp, seq_len, fixed):
            c = Candidate(
                tp=tp,
                pp=pp,
                dp=dp,
                cp=cp,
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
            _evaluate(shape, hw, c, seq_len, global_batch, lora, memory_fraction, documents, objective)
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
            f"no layout of {world} ranks has {fixed}: tp, cp and pp must divide the world size, "
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
    objective: str = "sft",
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
    (``neuron_parallel.planning.attention``) may hold an explicit mask or fp32 scores.
    ``objective`` (``train.objective``): dpo under ``lora`` adds the reference forward of the
    base to every micro-batch (``neuron_parallel.planning.reference``)."""
    fixed = _check_arguments(fixed, precision, nodes, seq_len, global_batch, memory_fraction)
    shape = ModelShape.from_config(model_config)
    hw = get_hardware(hardware, ranks_per_node)
    world = nodes * hw.ranks_per_node
    args = (shape, hw, world, seq_len, global_batch, precision, fixed, lora, memory_fraction, documents, objective)
    candidates = sorted(_candidates(*args), key=_rank_key)
    report = LayoutSearch(
        shape, hw, nodes, seq_len, global_batch, precision, candidates, lora=lora, memory_fraction=memory_fraction
    )
    report.documents, report.objective = documents, objective
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
        for c in rejected:  # one per (tp, pp, cp), the closest to fitting first
            if (c.tp, c.pp, c.cp) not in seen and len(seen) < 6:
                seen.add((c.tp, c.pp, c.cp))
                lines.append(f"  {c.describe()}: {c.reason}")
    lines.append(f"feasible: {report.feasible}" + (f" — {report.reason}" if report.reason else ""))
    return "\n".join(lines)
