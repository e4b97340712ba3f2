"""The measurements a training step may carry, as a list the trainer walks (``instruments``).

Each instrument says when it is due (``due(step)``), measures on the step's first micro-batch, and
hands its metrics to the next log record once (``pop``). Most measure the batch with passes of
their own, before it trains, leaving the run as it was (``measure``). One kind takes the
micro-batch's training pass over instead (``TapedProbe``): the probe in one process, whose taped
training backward is its repeat 0 (``train``, then ``measure`` once the statistics are off).
"""

from __future__ import annotations

from typing import Any

import torch

from readback.probe import GradientProbe, train_taped
from readback.probe.settings import DTYPES, Probe


class _Pending:
    """Metrics measured since the last record, handed over once."""

    def __init__(self) -> None:
        self.pending: dict[str, float] = {}

    def pop(self) -> dict[str, float]:
        found, self.pending = self.pending, {}
        return found


class ProbeBeforeTraining(_Pending):
    """The gradient probe with several processes: their backward reduces or shards the gradients,
    so the probe runs the batch itself, before it trains."""

    def __init__(self, probe: GradientProbe) -> None:
        super().__init__()
        self.probe = probe

    def due(self, step: int) -> bool:
        return self.probe.due(step)

    def measure(self, model: Any, x: torch.Tensor, y: torch.Tensor, stream: Any) -> None:
        self.pending = self.probe.measure(model, x, y)


class TapedProbe(ProbeBeforeTraining):
    """The gradient probe in one process: the micro-batch trains taped, and that training
    backward is the probe's repeat 0 (a probed step costs the step plus the reference)."""

    def train(self, model: Any, x: torch.Tensor, y: torch.Tensor, micro_batches: int) -> torch.Tensor:
        loss, self._trained = train_taped(model, x, y, micro_batches=micro_batches)
        return loss

    def measure(self, model: Any, x: torch.Tensor, y: torch.Tensor, stream: Any) -> None:
        trained, self._trained = self._trained, None
        self.pending = self.probe.measure(model, x, y, trained)


class TrainingBiasMeter(_Pending):
    """The bias meter (:mod:`readback.bias`) every ``probe.bias_every`` steps, over the first
    ``probe.bias_batches`` validation batches, at this step's weights and scales; its reference
    replay in ``probe.dtype``, as the probe's."""

    def __init__(self, every: int, batches: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.every, self.batches, self.dtype = every, batches, dtype

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def measure(self, model: Any, x: torch.Tensor, y: torch.Tensor, stream: Any) -> None:
        from readback.bias import measure_bias

        device = next(model.parameters()).device
        batches = [(vx.to(device), vy.to(device)) for vx, vy in stream.val_batches(self.batches)]
        self.pending = measure_bias(model, batches, dtype=self.dtype).metrics()


def instruments(settings: Probe, distributed: bool) -> list[ProbeBeforeTraining | TrainingBiasMeter]:
    """The run's instruments, in the order they measure and their metrics appear in a record."""
    probe = GradientProbe(settings)
    return [
        (ProbeBeforeTraining if distributed else TapedProbe)(probe),
        TrainingBiasMeter(settings.bias_every, settings.bias_batches, DTYPES[settings.dtype]),
    ]


def due_at(
    step: int, run_instruments: list[ProbeBeforeTraining | TrainingBiasMeter]
) -> tuple[list[ProbeBeforeTraining | TrainingBiasMeter], TapedProbe | None]:
    """The instruments due at ``step``: those that measure the step's first micro-batch before
    it trains, in their order, and the taped probe, which takes that training pass as its own."""
    due = [i for i in run_instruments if i.due(step)]
    return [i for i in due if not isinstance(i, TapedProbe)], next((i for i in due if isinstance(i, TapedProbe)), None)
