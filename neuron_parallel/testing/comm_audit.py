"""What a training step communicates, counted, and the least its layout must communicate.

:class:`CollectiveLog` is a ``TorchDispatchMode`` that records every collective dispatched while
it is active, whoever issues it: ``torch.distributed`` calls (``c10d`` ops: the dp buckets'
all-reduces, ZeRO-1's broadcasts, the pipeline's send/recv, object collectives), DTensor's
functional collectives (``_c10d_functional`` ops), and the ones DTensor issues inside its own op
dispatch (for DTensor arguments the mode returns ``NotImplemented``, so DTensor desugars first and
its collectives reach the mode, the method of torch's ``CommDebugMode``). ``CommDebugMode`` itself
counts operations only, without point-to-point ops, groups or bytes, hence this log.

Bytes are payload bytes: the whole tensor a collective is about (all-reduce: the tensor; all-gather:
the gathered result; reduce-scatter: the input before scattering; broadcast, send, recv: the
tensor), the same convention as :func:`minimum_bytes`.

:func:`minimum_bytes` is the least one optimizer step of a layout moves on one rank: Megatron-style
TP+SP per decoder layer an all-gather and a reduce-scatter of the activations for attention and for
the MLP, forward and backward (all-reduces without SP), one more pair at the vocab-parallel
embedding and lm_head, three per-token fp32 vectors for the vocab-parallel cross entropy, and the
sum of the gradients of replicated weights (SP norms, replicated KV heads); CP per decoder layer
the all-gather of the whole row's keys and values (``2·b·S·kv·d`` elements,
``neuron_parallel.planning.timing.kv_exchange_bytes``, the planner's own count) forward and the
reduce-scatter of their gradients backward, the activations above counting each rank's ``S/cp``
tokens; PP one activation and one gradient per microbatch per stage boundary; DP one reduction of
the gradient bytes over the dp × cp ranks (the ``dp_cp`` group: named ``dp`` or ``cp`` where the
other degree is 1); ZeRO-1 one copy of the parameters to each of them.

Run as a module under torchrun (``run_ranks(RANK_MODULE, n, [job.json])``), each rank builds the
job's engine through the training path, trains step 1 (the pipeline's shape inference sends
objects on the first step only), records step 2 and reports its :func:`rank_report`
(:func:`audit_rank`); :func:`aggregate` sums the ranks' rows. ``bench/comm.py`` and
``tests/dist/test_comm.py`` both run this audit.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from ..parallel.dtensor import local
from ..planning.model import ModelShape
from ..planning.timing import kv_exchange_bytes

KINDS = {
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "_allgather_base_": "all_gather",
    "allgather_": "all_gather",
    "allgather_coalesced_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "broadcast_": "broadcast",
    "broadcast": "broadcast",
    "reduce_": "reduce",
    "send": "send",
    "recv_": "recv",
    "recv_any_source_": "recv",
    "alltoall_": "all_to_all",
    "alltoall_base_": "all_to_all",
    "all_to_all_single": "all_to_all",
    "gather_": "gather",
    "scatter_": "scatter",
    "barrier": "barrier",
    "monitored_barrier_": "barrier",
}
"""Collective op (``c10d`` or ``_c10d_functional`` namespace) → kind."""
_FULL_ARG = {"reduce_scatter_": 1, "_reduce_scatter_base_": 1, "reduce_scatter_tensor_coalesced_": 1, "alltoall_": 1}
_FULL_ARG["alltoall_base_"] = 1
"""The argument holding the whole tensor(s) where it is not the first (the unscattered input)."""
SCALAR_NUMEL = 16
"""Collectives of at most this many elements are "scalars" (losses, token counts, the norm)."""


@dataclass(frozen=True, slots=True)
class Collective:
    """One collective as this rank issued it."""

    kind: str
    axis: str
    nbytes: int
    numel: int
    phase: str

    @property
    def scalar(self) -> bool:
        return self.numel <= SCALAR_NUMEL


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, list | tuple):
        for y in x:
            yield from _tensors(y)


class CollectiveLog(TorchDispatchMode):
    """Records every collective dispatched while active (``with log:``) as a :class:`Collective`.
    ``axes`` names process groups by their sorted global ranks (e.g. ``axis_names(mesh)``); a
    group inside a named one takes its name, the whole world is ``world``, a group of one ``self``."""

    def __init__(self, axes: dict[tuple[int, ...], str] | None = None) -> None:
        super().__init__()
        self.axes = dict(axes or {})
        self.records: list[Collective] = []
        self.current = ""
        self._names: dict[object, str] = {}

    @contextlib.contextmanager
    def phase(self, name: str):
        """Label the collectives issued inside the block ``name``."""
        before, self.current = self.current, name
        try:
            yield
        finally:
            self.current = before

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor first: its own collectives then come back through here
        if func.namespace in ("c10d", "_c10d_functional"):
            op = func._schema.name.split("::")[1]
            if op in KINDS:
                self._record(op, func._schema, args)
        return func(*args, **(kwargs or {}))

    def _record(self, op: str, schema, args) -> None:
        functional = op in ("all_gather_into_tensor", "all_gather_into_tensor_coalesced")
        full = list(_tensors(args[_FULL_ARG.get(op, 0)]))
        numel = sum(t.numel() for t in full) * (args[1] if functional else 1)
        nbytes = sum(t.numel() * t.element_size() for t in full) * (args[1] if functional else 1)
        where = next(i for i, a in enumerate(schema.arguments) if a.name in ("process_group", "group_name"))
        group = args[where]
        self.records.append(Collective(KINDS[op], self._axis(group), nbytes, numel, self.current))

    def _axis(self, group) -> str:
        if isinstance(group, torch.ScriptObject):  # how c10d ops carry their ProcessGroup
            group = dist.ProcessGroup.unbox(group)
        key = group if isinstance(group, str) else group.group_name
        if key not in self._names:
            pg = dist.distributed_c10d._resolve_process_group(group) if isinstance(group, str) else group
            ranks = tuple(sorted(dist.get_process_group_ranks(pg)))
            name = "self" if len(ranks) == 1 else self.axes.get(ranks)
            if name is None:
                inside = [(len(r), n) for r, n in self.axes.items() if set(ranks) <= set(r)]
                name = "world" if len(ranks) == dist.get_world_size() else min(inside, default=(0, "group"))[1]
            self._names[key] = name
        return self._names[key]


def axis_names(mesh) -> dict[tuple[int, ...], str]:
    """This rank's group of every axis of a ``("dp", ["cp",] "pp", "tp")`` device mesh, by sorted ranks."""
    return {tuple(sorted(dist.get_process_group_ranks(mesh[a].get_group()))): a for a in mesh.mesh_dim_names}


def _local_bytes(params) -> int:
    return sum(local(p).numel() * local(p).element_size() for p in params)


def _owed_sums(engine, sp: bool) -> int:
    """Bytes of the trainable weights replicated over (part of) tp whose grads are partial sums:
    under SP every replicated one (the norms run on sequence shards); without SP those on a
    sub-mesh of tp (replicated KV heads) and LoRA's A over column-parallel layers."""
    owed = []
    for name, p in engine.named_parameters():
        if not isinstance(p, DTensor) or not any(pl.is_replicate() for pl in p.placements):
            continue
        if sp or p.device_mesh.ndim > 1 or name.endswith(".lora_A"):
            owed.append(p)
    return _local_bytes(owed)


def minimum_bytes(engine, job) -> dict[tuple[str, str], float]:
    """The least one optimizer step of ``engine`` (one rank of ``job``'s layout) moves, per
    ``(kind, axis)``, in payload bytes (see the module docstring). Activation recompute, which
    repeats the forward's collectives in backward, is not counted."""
    pc, dims, h = job.parallel, engine.dims, engine.config.hidden_size
    sp = pc.sequence_parallel and dims.tp > 1
    m = pc.num_microbatches if dims.pp > 1 else 1
    rows = job.train.micro_batch_size // m  # one microbatch
    tokens = rows * job.block_size // dims.cp  # of which this rank holds S/cp positions a row
    passes = job.grad_accum * m  # microbatch forward+backward passes per stage and step
    act = 2 if pc.mixed_precision == "bf16" else 4
    out: dict[tuple[str, str], float] = defaultdict(float)
    if dims.tp > 1:
        for part in engine.parts:
            n = 4 * len(part.model.layers) + int(part.first) + int(part.last)
            for kind in ("all_gather", "reduce_scatter") if sp else ("all_reduce",):
                out[(kind, "tp")] += n * passes * tokens * h * act
            if part.last:  # vocab-parallel cross entropy: max, sum of exponentials, target logit
                out[("all_reduce", "tp")] += 3 * passes * tokens * 4
        out[("all_reduce", "tp")] += _owed_sums(engine, sp)
    if dims.cp > 1:
        kv = kv_exchange_bytes(ModelShape.from_config(engine.config), dims.tp, rows, job.block_size, act)
        layers = sum(len(part.model.layers) for part in engine.parts)
        out[("all_gather", "cp")] += layers * passes * kv
        out[("reduce_scatter", "cp")] += layers * passes * kv
    if dims.pp > 1:
        _pipeline_minimum(engine, out, passes * tokens * h * act / (dims.tp if sp else 1))
    replicas = replica_axis(dims)
    if dims.dp * dims.cp > 1:
        out[("all_reduce", replicas)] += _local_bytes(engine.parameters())
        if pc.zero_1:
            out[("broadcast", replicas)] += _local_bytes(engine.parameters())
    return dict(out)


def replica_axis(dims) -> str:
    """The name the log gives the ``dp_cp`` group (the ranks holding the same parameters): ``dp``
    without cp, ``cp`` without dp, else ``dp_cp`` (:func:`audit_rank` names it so)."""
    return "dp" if dims.cp == 1 else "cp" if dims.dp == 1 else "dp_cp"


def _pipeline_minimum(engine, out: dict, per_boundary: float) -> None:
    """Per stage boundary this rank sits on (with another rank): every microbatch's activation
    forward and its gradient backward; with tied embeddings split over stages, the pair's grads."""
    from ..parallel.pipeline import stage_ids_for_rank

    pc = engine.job.parallel
    layout = {"pp": pc.pp, "virtual_stages": pc.virtual_stages, "schedule": pc.pipeline_schedule}
    rank_of = {s: r for r in range(pc.pp) for s in stage_ids_for_rank(r, **layout)}
    me = engine.dims.mesh["pp"].get_local_rank()
    for s in engine.stage_ids:
        for peer in (s - 1, s + 1):
            if 0 <= peer < pc.num_stages and rank_of[peer] != me:
                out[("send", "pp")] += per_boundary
                out[("recv", "pp")] += per_boundary
    if engine.tied and engine.tied_trainable and rank_of[0] != rank_of[pc.num_stages - 1]:
        tied = [p for n, p in engine.named_parameters() if n in ("model.embed_tokens.weight", "lm_head.weight")]
        for kind in ("send", "recv"):
            out[(kind, "pp")] += _local_bytes(tied)


@contextlib.contextmanager
def engine_phases(engine, log: CollectiveLog):
    """While inside, the collectives of ``engine``'s ``forward_backward``, ``reduce_and_clip`` and
    ``optimizer_step`` are labelled with those names (the rest keeps the log's current phase)."""
    names = ("forward_backward", "reduce_and_clip", "optimizer_step")

    def labelled(name, fn):
        def call(*args, **kwargs):
            with log.phase(name):
                return fn(*args, **kwargs)

        return call

    for name in names:
        setattr(engine, name, labelled(name, getattr(engine, name)))
    try:
        yield
    finally:
        for name in names:
            delattr(engine, name)  # the class's methods show through again


def rank_report(log: CollectiveLog, engine, job) -> dict:
    """This rank's collectives as JSON-able rows ``{kind, axis, scalar, count, bytes, minimum_bytes,
    phases: {phase: count}}`` (a row per kind and axis with a minimum, even if nothing was sent),
    and the number of trainable parameters it holds."""
    minimum = minimum_bytes(engine, job)
    rows: dict[tuple[str, str, bool], dict] = {}
    for (kind, axis), nbytes in minimum.items():
        rows[(kind, axis, False)] = dict(kind=kind, axis=axis, scalar=False, count=0, bytes=0, minimum_bytes=nbytes)
    for r in log.records:
        row = rows.setdefault(
            (r.kind, r.axis, r.scalar),
            dict(kind=r.kind, axis=r.axis, scalar=r.scalar, count=0, bytes=0, minimum_bytes=0.0),
        )
        row["count"] += 1
        row["bytes"] += r.nbytes
        row.setdefault("phases", {})
        row["phases"][r.phase or "step"] = row["phases"].get(r.phase or "step", 0) + 1
    return {"rows": list(rows.values()), "num_params": len(engine.parameters())}


RANK_MODULE = "neuron_parallel.testing.comm_audit"
"""What ``run_ranks`` runs for the audit: this module, with a job.json as its argument."""
LAYOUTS = {
    "dp2-tp2-pp2": (8, dict(tp=2, pp=2, sequence_parallel=True, zero_1=True, num_microbatches=2)),
    "tp4": (4, dict(tp=4, sequence_parallel=True)),
    "dp2-cp2": (4, dict(cp=2, zero_1=True)),
}
"""The audited layouts: world size and ``ParallelConfig.for_world`` settings. ``dp2-tp2-pp2``:
sequence parallel, ZeRO-1, 1F1B with 2 microbatches; ``tp4``: sequence parallel, the tiny
model's 2 KV heads each replicated on 2 ranks; ``dp2-cp2``: context parallel (the K/V exchange
over cp), the gradients reduced and ZeRO-1 sharded over all four dp × cp ranks."""
GOAL = 1.10
"""The most bytes a step may move, as a multiple of its layout's minimum."""


def audit_rank(job_path: str) -> dict:
    """One rank (inside torchrun, process group not yet started): build the engine of the job
    at ``job_path``, train step 1, record step 2; this rank's :func:`rank_report` and its mesh
    coordinates."""
    from ..batches import BlockStream
    from ..config import JobConfig
    from ..engine import build_engine
    from ..mesh import ParallelDims, init_distributed, local_device
    from ..train import Trainer

    job = JobConfig.load(job_path)
    init_distributed(job.device)
    pc = job.parallel
    dims = ParallelDims(dp=pc.dp, cp=pc.cp, pp=pc.pp, tp=pc.tp, device_type=job.device)
    engine = build_engine(job, dims, local_device(job.device))
    trainer = Trainer(job, engine, BlockStream(job.dataset_path, seed=job.train.seed), dims, None, None)
    trainer.train_step(1)
    axes = axis_names(dims.mesh)
    axes.setdefault(tuple(sorted(dist.get_process_group_ranks(dims.group("dp_cp")))), replica_axis(dims))
    log = CollectiveLog(axes)
    with log, engine_phases(engine, log):
        trainer.train_step(2)
    return {**rank_report(log, engine, job), **dims.coordinates()}


def aggregate(results: list[dict]) -> list[dict]:
    """The ranks' rows (:func:`rank_report`) summed per kind, axis and scalar-ness, each with the
    worst rank's ratio of bytes to the minimum, the overall ``ratio`` and the per-phase counts."""
    rows: dict[tuple, dict] = {}
    for res in results:
        for r in res["rows"]:
            key = (r["kind"], r["axis"], r["scalar"])
            row = rows.setdefault(
                key,
                dict(kind=r["kind"], axis=r["axis"], scalar=r["scalar"], count=0, bytes=0, minimum_bytes=0.0),
            )
            row.setdefault("phases", defaultdict(int))
            row.setdefault("worst_rank_ratio", 0.0)
            row["count"] += r["count"]
            row["bytes"] += r["bytes"]
            row["minimum_bytes"] += r["minimum_bytes"]
            for phase, c in r.get("phases", {}).items():
                row["phases"][phase] += c
            if r["minimum_bytes"]:
                row["worst_rank_ratio"] = max(row["worst_rank_ratio"], r["bytes"] / r["minimum_bytes"])
    out = sorted(rows.values(), key=lambda r: (r["scalar"], r["axis"], r["kind"]))
    for r in out:
        r["ratio"] = r["bytes"] / r["minimum_bytes"] if r["minimum_bytes"] else None
        r["phases"] = dict(r["phases"])
    return out


def main(argv: list[str]) -> int:
    """``python -m neuron_parallel.testing.comm_audit JOB_JSON`` on every rank: the audit of one
    step, reported with ``print_rank_result``."""
    from ..mesh import close_distributed
    from .ranks import print_rank_result

    print_rank_result(audit_rank(argv[0]))
    close_distributed()
    return 0


if __name__ == "__main__":
    import sys

    from ..mesh import exit_rank

    exit_rank(main(sys.argv[1:]))
