"""The rows of ``metrics.jsonl`` with no host sync per step.

A training step leaves its loss and gradient norm on the device (:class:`PendingStep`). At a step
that logs, evaluates or checkpoints, :meth:`StepRows.close` synchronizes the device once, reads
the values of every step since the last such point in one transfer, and times those steps: the
wall time between two synchronized points shared equally among the steps between them, so a
row's ``step_time_s`` (and ``tokens_per_s``) is what the device took, not how fast the host
queued the work. Time spent between windows on anything but training (an evaluation, a
checkpoint save, writing the rows) is left out: :meth:`StepRows.restart` opens the next window
after it, synchronized.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


def synchronize(device: torch.device | str) -> None:
    """Wait until ``device`` (a ``torch.device``, or a device type such as ``"cuda"``) has run all
    the work queued on it: ``torch.accelerator`` where it serves this device type, else the
    device's own module (``torch.cuda``, ``torch.neuron``), else ``torch.accelerator`` (which
    raises where nothing serves the device); nothing on CPU, whose operations run when called.
    Without an index, the current device (``mesh.local_device``)."""
    kind = device if isinstance(device, str) else device.type
    if kind == "cpu":
        return
    index = () if isinstance(device, str) or device.index is None else (device.index,)
    accelerator = torch.accelerator
    if accelerator.is_available():
        current = accelerator.current_accelerator()
        if current is not None and current.type == kind:
            accelerator.synchronize(*index)
            return
    module = getattr(torch, kind, None)
    if module is not None and hasattr(module, "synchronize"):
        module.synchronize(*index)
        return
    accelerator.synchronize(*index)


@dataclass
class PendingStep:
    """A trained step whose device values are not read yet."""

    step: int
    lr: float
    tokens_seen: int
    trained_tokens: int
    """Labelled tokens of the whole global batch (counted on the host)."""
    loss_sum: torch.Tensor
    """0-d: the summed token loss over the global batch (the same on every rank)."""
    grad_norm: torch.Tensor
    """0-d: the global gradient norm before clipping."""
    pairs: int | None = None
    """Preference objectives: the pairs of the global batch (counted on the host), by which the
    loss and ``pair_sums`` are divided instead of the labelled tokens."""
    pair_sums: torch.Tensor | None = None
    """Preference objectives: ``neuron_parallel.preference.STATS`` summed over the global batch."""


class StepRows:
    """The pending steps of one rank and the clock that times them. Built where training starts
    (it synchronizes there, so the first window holds training alone)."""

    def __init__(self, device: torch.device, tokens_per_step: int) -> None:
        self.device = device
        self.tokens_per_step = tokens_per_step
        self.pending: list[PendingStep] = []
        synchronize(device)
        self.t_start = self.t_open = time.perf_counter()

    def add(self, step: PendingStep) -> None:
        self.pending.append(step)

    def close(self) -> list[dict]:
        """Synchronize, read every pending step's loss and gradient norm (one transfer) and give
        each step an equal share of the time since the window opened: their rows, in step order
        (``loss`` is the summed loss / the labelled tokens, as one process computes it;
        ``elapsed_s`` is the wall time since training started at the step's end)."""
        synchronize(self.device)
        now = time.perf_counter()
        pending, self.pending = self.pending, []
        if not pending:
            self.t_open = now
            return []
        share = (now - self.t_open) / len(pending)
        values = torch.stack([self._values(p) for p in pending]).tolist()
        rows = []
        for i, (p, (loss_sum, grad_norm, *pair_sums)) in enumerate(zip(pending, values)):
            count = p.trained_tokens if p.pairs is None else p.pairs
            rows.append(
                {
                    "step": p.step,
                    "loss": loss_sum / max(count, 1),
                    "lr": p.lr,
                    "grad_norm": grad_norm,
                    "tokens_per_s": self.tokens_per_step / share,
                    "tokens_seen": p.tokens_seen,
                    "trained_tokens": p.trained_tokens,
                    "step_time_s": share,
                    "elapsed_s": self.t_open - self.t_start + share * (i + 1),
                }
            )
            if p.pairs is not None:
                from .preference import stats_row

                rows[-1].update({**stats_row(pair_sums, p.pairs), "pairs": p.pairs})
        self.t_open = now
        return rows

    @staticmethod
    def _values(p: PendingStep) -> torch.Tensor:
        """The loss and gradient norm of ``p``, then its pair sums where it has them (every pending
        step of a run has the same kind)."""
        head = torch.stack([p.loss_sum.float(), p.grad_norm.float()])
        return head if p.pair_sums is None else torch.cat([head, p.pair_sums.float()])

    def restart(self) -> None:
        """Open the next window now, once the device has finished what came since :meth:`close`."""
        synchronize(self.device)
        self.t_open = time.perf_counter()
