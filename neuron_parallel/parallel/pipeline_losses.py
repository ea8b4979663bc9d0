"""What the last pipeline stage computes per microbatch, by objective (a ``PipelineRunner``'s
``loss_fn`` and ``value_shape``): the token loss (sft), or under a preference objective
(:mod:`neuron_parallel.preference`) the summed pair statistics, with, for DPO under LoRA, the
forward-only reference pass that precedes each micro-batch's training pass.

Per microbatch the runner hands the loss function that microbatch's rows of the batch's labels,
sequence ids and reference log-probabilities (``PipelineRunner.step``'s ``extras``), found on the
device by row index, and sums the values it returns over the microbatches; the loss scale stays
the preference rule's (``PAIR_LOSS_RULE``: the mean over the pairs of the global batch, counted on
the host), so a pipeline trains exactly as one process does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..preference import STATS, completion_logps, pair_stats, slots

if TYPE_CHECKING:
    from ..config import PreferenceConfig


class PairLoss:
    """The last pipeline stage's function of one microbatch under a preference objective (a
    ``PipelineRunner``'s ``loss_fn``): from the final norm's output and the microbatch's rows of
    labels, sequence ids and, under DPO, reference log-probabilities (rows, slots), the
    :func:`pair_stats` of its pairs, the summed loss first, which the runner differentiates.
    Pairs never cross rows, so the microbatches' sums add up to the batch's."""

    def __init__(self, stage, objective: str, cfg: PreferenceConfig) -> None:
        self.stage, self.objective, self.cfg = stage, objective, cfg

    def __call__(self, hidden, labels, sequence_ids, reference=None) -> torch.Tensor:
        sums, counts = completion_logps(self.stage, hidden, labels, sequence_ids)
        ref = reference.view(sums.shape) if reference is not None else None
        return pair_stats(self.objective, self.cfg, sums, counts, ref)


class CompletionLogps:
    """The last pipeline stage's function of one microbatch in the reference pass: each row's
    summed log-probability of each completion, by sequence id, ``(rows, slots)`` (the layout of
    the reference step's values, which :class:`PairLoss` takes)."""

    def __init__(self, stage) -> None:
        self.stage = stage

    def __call__(self, hidden, labels, sequence_ids) -> torch.Tensor:
        sums, _ = completion_logps(self.stage, hidden, labels, sequence_ids)
        return sums.flatten(1)


def pipeline_loss(job, stage) -> dict:
    """The ``loss_fn`` and ``value_shape`` of ``job``'s training pipeline (``stage``: this rank's
    last stage module): the token loss (sft), or :class:`PairLoss` and its :data:`STATS`."""
    tc = job.train
    if tc.objective == "sft":
        return {"loss_fn": stage.loss}
    return {"loss_fn": PairLoss(stage, tc.objective, tc.preference), "value_shape": (len(STATS),)}


def reference_runner(job, runner):
    """The forward-only runner of the reference pass of ``job`` (over ``runner``'s stages) when
    its reference is the base with its adapters off (DPO under LoRA,
    :func:`~neuron_parallel.planning.reference.reference_forward`), else None.

    The reference's log-probabilities of a micro-batch need the base's forward through every
    stage, with the policy's forward of the same rows still to come on the last stage. The
    training schedule cannot run a second forward inside its microbatches, so the engine runs
    the reference first, as a pass of its own under ``torch.no_grad`` with every adapter off, and
    hands its values, held by the last stage's rank, to the training pass as rows of
    :class:`PairLoss`: the same forward of the same rows as one process runs, so the same numbers.
    The pass has a runner of its own (``PipelineRunner.forward_only``), so that the training
    schedule is not re-initialised twice a step."""
    from ..planning.reference import reference_forward

    if not reference_forward(job.train.objective, job.train.lora):
        return None
    rows = job.train.micro_batch_size // job.parallel.num_microbatches
    return runner.forward_only(CompletionLogps(runner.modules[-1]), (rows, slots(job.block_size)))
