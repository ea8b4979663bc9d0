"""Pipeline parallelism: which stages a rank holds, building them, and running a schedule.

The model is cut into ``pp × virtual_stages`` stages of consecutive decoder layers
(:func:`neuron_parallel.utils.split_layers`). Stage ``s`` lives on pp rank:

* ``gpipe`` / ``1f1b``: ``s`` (one stage per rank);
* ``interleaved_1f1b``: ``s % pp`` ("loop" placement: rank r holds r, r+pp, r+2pp, …);
* ``zbv``: rank r holds r and ``2·pp−1−r`` ("V" placement, so rank 0 holds the first *and*
  the last stage).

:class:`PipelineRunner` wraps ``torch.distributed.pipelining`` (manual ``PipelineStage`` plus a
schedule) around stage modules that are already materialised, loaded and, if asked, sharded by
tensor parallelism: ``PipelineStage`` must see the final modules. Everything here uses only
point-to-point ops and all-reduce on the pp process group, so it runs unchanged on gloo, nccl
and the neuron backend.

Per rank, in order (``neuron_parallel.engine``): ``build_stages`` → LoRA adapters, if any → TP
plan → ``materialize`` + ``load_weights`` → ``train()`` → ``PipelineRunner`` → per optimizer step,
``step`` once per accumulation micro-batch (every pp rank calls it; the last one's backward starts
the dp reduction), then the dp reduction finished, ``sum_tied_embedding_grads`` if the embeddings
are tied, the optimizer.
Activations crossing stages should be plain tensors (TP layers with local outputs); logits and
loss may be DTensors. torch requires ``num_microbatches >= pp`` for 1f1b.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)

from ..batches import to_device
from ..models.causal_lm import CausalLMStage
from ..utils import split_layers
from .dtensor import align_grad, full, local

SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "zbv": ScheduleZBVZeroBubble,
}
MULTI_STAGE_SCHEDULES = ("interleaved_1f1b", "zbv")
FORWARD_ACTIONS = frozenset({"F", "RECV_F", "SEND_F", "UNSHARD", "RESHARD"})
"""The actions of a multi-stage schedule's plan that a forward-only pass runs (torch's
``_ComputationType`` values: forward, its receive and send, FSDP's unshard and reshard)."""


def stage_ids_for_rank(pp_rank: int, pp: int, virtual_stages: int, schedule: str) -> list[int]:
    """Global stage indices held by pp rank ``pp_rank``, in pipeline order. No communication."""
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline schedule {schedule!r} is not one of {tuple(SCHEDULES)}")
    if pp < 1 or not 0 <= pp_rank < pp:
        raise ValueError(f"pp_rank={pp_rank} must lie in [0, pp={pp})")
    if schedule not in MULTI_STAGE_SCHEDULES:
        if virtual_stages != 1:
            raise ValueError(f"schedule {schedule} holds one stage per rank; got virtual_stages={virtual_stages}")
        return [pp_rank]
    if schedule == "interleaved_1f1b":
        if virtual_stages < 2:
            raise ValueError(f"interleaved_1f1b needs virtual_stages >= 2, got {virtual_stages}; use 1f1b")
        return [pp_rank + v * pp for v in range(virtual_stages)]
    if virtual_stages != 2:
        raise ValueError(f"zbv uses exactly 2 virtual stages per rank, got {virtual_stages}")
    return [pp_rank, 2 * pp - 1 - pp_rank]


def build_stages(
    full_meta_model: nn.Module,
    config,
    *,
    pp_rank: int,
    pp: int,
    virtual_stages: int,
    schedule: str,
    layer_split: list[int] | None = None,
    recompute_every: int = 0,
) -> list[CausalLMStage]:
    """This rank's stage modules, still on the meta device, in the order of
    :func:`stage_ids_for_rank`. ``config`` is the Hugging Face model config. No communication.

    Materialise (and shard) them before handing them to :class:`PipelineRunner`."""
    num_stages = pp * virtual_stages
    ranges = split_layers(config.num_hidden_layers, num_stages, layer_split)
    return [
        CausalLMStage(
            full_meta_model,
            ranges[sid],
            first=sid == 0,
            last=sid == num_stages - 1,
            recompute_every=recompute_every,
        )
        for sid in stage_ids_for_rank(pp_rank, pp, virtual_stages, schedule)
    ]


class PipelineRunner:
    """Wraps torch.distributed.pipelining PipelineStage(s) + schedule for this rank.

    ``stages`` are this rank's built modules (materialised, weights loaded, possibly TP-sharded)
    and ``stage_ids`` their global indices. ``loss_fn(output, labels, *extras)`` returns the value
    of one microbatch from the last stage's output and the microbatch's rows of ``step``'s
    ``labels`` and ``extras``: its loss, a sum over its labelled tokens
    (:func:`~neuron_parallel.models.causal_lm.causal_lm_loss` of logits, or the engine's
    :meth:`~neuron_parallel.models.causal_lm.CausalLMStage.loss` of the final norm's output), or
    a tensor of ``value_shape`` whose first entry is the loss (the preference objectives' summed
    pair statistics, :class:`~neuron_parallel.parallel.pipeline_losses.PairLoss`).
    ``loss_scale`` (an attribute, settable between calls) multiplies the loss used for backward,
    e.g. ``1 / labelled tokens of the global batch``; ``step`` returns the unscaled values summed
    over the microbatches.

    The schedule's target is the batch's row indices, which torch splits into microbatches as
    it splits the inputs: the loss function of a microbatch finds its rows of every per-row
    tensor with them (an ``index_select`` on the device) and writes its value into the
    microbatch's slot (``rows[0] // rows per microbatch``), so nothing is read back to the host
    and the values do not depend on the order in which a schedule runs the microbatches.
    """

    def __init__(
        self,
        stages: list[nn.Module],
        stage_ids: list[int],
        num_stages: int,
        *,
        pp_group: dist.ProcessGroup | None,
        device: torch.device,
        schedule: str,
        num_microbatches: int,
        loss_fn: Callable[..., torch.Tensor],
        loss_scale: float = 1.0,
        value_shape: tuple[int, ...] = (),
    ) -> None:
        if schedule not in SCHEDULES:
            raise ValueError(f"pipeline schedule {schedule!r} is not one of {tuple(SCHEDULES)}")
        if len(stages) != len(stage_ids) or not stages:
            raise ValueError(f"got {len(stages)} stage modules for stage ids {stage_ids}")
        if (len(stages) > 1) != (schedule in MULTI_STAGE_SCHEDULES):
            raise ValueError(f"schedule {schedule} cannot run {len(stages)} stage(s) per rank")
        self.modules = list(stages)
        self.stage_ids = list(stage_ids)
        self.num_stages = num_stages
        self.pp_group = pp_group
        self.device = torch.device(device)
        self.num_microbatches = num_microbatches
        self.schedule_name = schedule
        self.loss_fn = loss_fn
        self.loss_scale = loss_scale
        self.value_shape = tuple(value_shape)
        self.has_first = 0 in stage_ids
        self.has_last = num_stages - 1 in stage_ids
        self._batch_shape: tuple[int, ...] | None = None
        self._rows: tuple[torch.Tensor, ...] = ()  # the step's labels and extras, on the last stage's rank
        self._rows_per_microbatch = 1
        self._values = torch.zeros(0)  # per microbatch, the step's values (num_microbatches, *value_shape)
        self.pipeline_stages = [
            PipelineStage(module, sid, num_stages, self.device, group=pp_group)
            for module, sid in zip(self.modules, self.stage_ids)
        ]
        # scale_grads=False: torch's grad scaling divides every p.grad in place after the step,
        # which would also shrink gradients accumulated by earlier step() calls. Scaling the
        # loss instead (see _loss) gives the same mean and composes with accumulation.
        cls = SCHEDULES[schedule]
        target = self.pipeline_stages if schedule in MULTI_STAGE_SCHEDULES else self.pipeline_stages[0]
        self.schedule = cls(target, n_microbatches=num_microbatches, loss_fn=self._loss, scale_grads=False)
        self._forward_plan = _forward_plan(self.schedule)

    def forward_only(self, loss_fn: Callable[..., torch.Tensor], value_shape: tuple[int, ...] = ()) -> PipelineRunner:
        """A runner over the same stage modules, with PipelineStages and a schedule of its own, for
        forward-only passes (``step`` under ``torch.no_grad``) with another last-stage function.

        torch initialises a schedule's stages for one mode: a forward-only ``step`` of this runner
        re-initialises them (shape inference: a forward of one microbatch per stage, receive
        buffers allocated again), and its next training ``step`` again (a forward and a backward).
        A pass run every training step (the reference forward of DPO under LoRA) takes the other
        runner, whose stages stay initialised for forward-only passes: the price is its own
        receive buffers, one activation per microbatch and stage input, for the whole run."""
        return PipelineRunner(
            self.modules,
            self.stage_ids,
            self.num_stages,
            pp_group=self.pp_group,
            device=self.device,
            schedule=self.schedule_name,
            num_microbatches=self.num_microbatches,
            loss_fn=loss_fn,
            value_shape=value_shape,
        )

    def _loss(self, output: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        # Called on the last stage once per microbatch with its row indices, and once more with
        # the first microbatch's when torch infers the stages' shapes at a schedule's first step
        # (on buffers without values): that value goes to slot 0 before the first microbatch
        # overwrites it. The value kept is unscaled; only the loss's gradient is scaled.
        value = self.loss_fn(output, *(t.index_select(0, rows) for t in self._rows))
        slot = rows[:1] // self._rows_per_microbatch
        self._values.index_copy_(0, slot, full(value.detach()).float().unsqueeze(0))
        return _ScaleGrad.apply(value if value.dim() == 0 else value[0], self.loss_scale)

    def step(
        self,
        inputs: torch.Tensor | None,
        labels: torch.Tensor,
        positions: torch.Tensor | None = None,
        *extras: torch.Tensor,
        documents: torch.Tensor | None = None,
        reduce: bool = True,
    ) -> torch.Tensor:
        """Forward and backward of one batch, split into ``num_microbatches``; gradients
        accumulate into the stage parameters (zero them yourself). Under ``torch.no_grad`` the
        forward only. Returns the sum of the microbatch values (unscaled, detached, fp32),
        identical on every pp rank; with ``reduce=False`` the values of each microbatch,
        ``(num_microbatches, *value_shape)``, as this rank holds them (zeros where the last stage
        does not live), without a collective.

        ``inputs`` (token ids) are needed only where the first stage lives; ``labels`` give the
        targets on the last stage (every rank passes them, for the shape check), as do
        ``extras``, more tensors of one row per sequence that the loss function takes (only the
        last stage's rank needs them). ``positions`` (document-packed rows) go with the inputs to
        the first stage, and each stage hands them on with its activations; so do ``documents``
        under context parallelism (the document of every position of the whole rows, with the
        positions of the rank's shard). Otherwise stages find the full sequence length for rotary
        positions from their input (see :class:`~neuron_parallel.models.causal_lm.CausalLMStage`).
        The batch shape must stay the same across calls: receive buffers are sized on the first
        call.

        Collectives: the schedule's send/recv between neighbouring stages on ``pp_group``
        (plus object send/recv for shape inference on the first call), then, with ``reduce``,
        one all-reduce of the summed values over ``pp_group``. Under TP + loss_parallel call this
        inside ``loss_parallel()``.
        """
        m = self.num_microbatches
        if labels.shape[0] % m:
            raise ValueError(
                f"the batch of {labels.shape[0]} sequences does not split into {m} equal microbatches; "
                f"make the per-rank batch a multiple of num_microbatches"
            )
        if self._batch_shape is None:
            self._batch_shape = tuple(labels.shape)
        elif tuple(labels.shape) != self._batch_shape:
            raise ValueError(
                f"batch shape {tuple(labels.shape)} differs from the first step's {self._batch_shape}; "
                "pipeline buffers are sized once, so keep micro_batch_size and block_size fixed"
            )
        if self.has_first and inputs is None:
            raise ValueError("this rank holds the first pipeline stage and needs the input ids")
        target = None
        if self.has_last:
            self._rows = tuple(to_device(t, self.device) for t in (labels, *extras))
            self._rows_per_microbatch = labels.shape[0] // m
            target = torch.arange(labels.shape[0], device=self.device)
        self._values = torch.zeros((m, *self.value_shape), dtype=torch.float32, device=self.device)
        args = ()
        if self.has_first:
            args = tuple(to_device(t, self.device) for t in (inputs, positions, documents) if t is not None)
        if torch.is_grad_enabled():
            self.schedule.step(*args, target=target, return_outputs=False)
        else:  # forward only; the stages' cached outputs are let go at once
            plan = getattr(self.schedule, "pipeline_order_with_comms", None)
            try:
                if plan is not None:
                    self.schedule.pipeline_order_with_comms = self._forward_plan
                self.schedule.eval(*args, target=target, return_outputs=False)
            finally:
                if plan is not None:
                    self.schedule.pipeline_order_with_comms = plan
            for stage in self.pipeline_stages:
                stage.clear_runtime_states()
        values, self._rows = self._values, ()
        if not reduce:
            return values
        total = values.sum(0)
        # Only the last stage's rank holds the values; a sum over pp hands them to every rank.
        dist.all_reduce(total, group=self.pp_group)
        return total


def _forward_plan(schedule) -> dict | None:
    """The plan of a multi-stage schedule (torch's ``_PipelineScheduleRuntime``: every action of
    every rank, communication included) less the backward's actions; None for a single-stage
    schedule. torch 2.13's ``eval`` runs the whole plan, whose backward actions do nothing
    without a backward, except zbv's ``BACKWARD_INPUT`` from a stage to the previous one on the
    same rank, which fails; the forwards keep their order, which the full plan runs without
    deadlock, and only wait on earlier forwards, so the shorter plan runs without deadlock too."""
    plan = getattr(schedule, "pipeline_order_with_comms", None)
    if plan is None:
        return None
    return {rank: [a for a in actions if a.computation_type in FORWARD_ACTIONS] for rank, actions in plan.items()}


class _ScaleGrad(torch.autograd.Function):
    """Identity in the forward pass; multiplies the incoming gradient by ``scale``. The loss
    keeps its value for reporting while backward sees ``loss × scale``, bit for bit."""

    @staticmethod
    def forward(ctx, loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return loss.clone()  # a new tensor, not a view: the schedule detaches the loss in place

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


def _aligned_grad(p: torch.Tensor) -> torch.Tensor:
    """The local shard of ``p.grad`` with the parameter's own placements (TP can deliver a
    vocab-sharded embedding's grad replicated), created as zeros if backward left none."""
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    else:
        align_grad(p)
    return local(p.grad)


def sum_tied_embedding_grads(
    stages: list[nn.Module],
    pp_group: dist.ProcessGroup | None,
    *,
    first_rank: int = 0,
    last_rank: int | None = None,
) -> None:
    """Tied embeddings: make ``model.embed_tokens.weight`` (first stage) and ``lm_head.weight``
    (last stage) carry the sum of both gradients, so the two copies of the one Hugging Face
    weight take identical updates. Call once per optimizer step, after all ``step`` calls and
    before clipping and the optimizer (before or after the dp all-reduce: the two commute).
    ``materialize`` unties a tied pair even inside one module, so call it for every tied model,
    pp=1 included; where the pair is still one Parameter it does nothing.

    ``first_rank``/``last_rank`` are the pp-group ranks of the first/last stage (default 0 and
    pp−1; with zbv both sit on rank 0 and are summed locally). Under TP both copies must be
    sharded alike (vocab-sharded ``Shard(0)``, as a row-wise embedding and a column-wise
    lm_head are) so that each tp rank's local shards correspond.

    Collectives: a DTensor grad whose placements differ from its parameter's is redistributed
    first (over the tp mesh); then one send and one recv of the local gradient shard between
    the two ranks only, each tp rank with its own peer. Ranks holding neither do nothing.
    """
    embed = next((s.model.embed_tokens.weight for s in stages if s.model.embed_tokens is not None), None)
    head = next((s.lm_head.weight for s in stages if s.lm_head is not None), None)
    if embed is None and head is None:
        return
    if embed is not None and head is not None:
        if embed is head:  # still one Parameter: autograd has already summed both uses
            return
        a, b = _aligned_grad(embed), _aligned_grad(head)
        if a.shape != b.shape:
            raise ValueError(
                f"tied embedding and lm_head grads are sharded differently: {tuple(a.shape)} vs {tuple(b.shape)}"
            )
        a.add_(b)
        b.copy_(a)
        return
    group = pp_group if pp_group is not None else dist.group.WORLD
    if last_rank is None:
        last_rank = dist.get_world_size(group) - 1
    mine = _aligned_grad(embed if embed is not None else head)
    peer = dist.get_global_rank(group, last_rank if embed is not None else first_rank)
    send = mine.contiguous()
    other = torch.empty_like(send)
    ops = [dist.P2POp(dist.isend, send, peer, group), dist.P2POp(dist.irecv, other, peer, group)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    # a + b == b + a exactly in IEEE arithmetic, so both ranks end with bit-identical sums.
    mine.add_(other)
