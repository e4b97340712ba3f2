"""Warmup-stable-decay learning rate with a 1-sqrt cooldown (the FOG recipe).

Steps are counted from 1: ``lr(t)`` is the learning rate of the ``t``-th optimizer update, the
one after which the trainer's step counter reads ``t`` (and which is logged as ``step=t``).

* warmup, ``t <= warmup_steps``: ``peak * t / warmup_steps`` (linear, never 0);
* stable: ``peak``;
* cooldown over the last ``cooldown_frac`` of the ``T`` steps, from ``t0 = T - round(cooldown_frac * T)``:
  ``min_lr + (peak - min_lr) * (1 - sqrt((t - t0) / (T - t0)))``, which reaches ``min_lr`` at ``t = T``.

When warmup and cooldown overlap (very short runs) the smaller of the two values is used.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from readback.train.settings import Optim


@dataclass(frozen=True)
class WSDSchedule:
    """``schedule(step) -> lr`` for steps ``1..steps``; stateless (the step is the state)."""

    peak: float
    steps: int
    warmup_steps: int
    cooldown_frac: float
    min_lr: float

    @property
    def cooldown_start(self) -> int:
        """``t0``: the last step at full (post-warmup) learning rate."""
        return self.steps - round(self.cooldown_frac * self.steps)

    def __call__(self, step: int) -> float:
        t = min(max(step, 1), self.steps)
        lr = self.peak
        if self.warmup_steps > 0 and t <= self.warmup_steps:
            lr = self.peak * t / self.warmup_steps
        t0, T = self.cooldown_start, self.steps
        if t > t0:
            frac = (t - t0) / (T - t0)
            lr = min(lr, self.min_lr + (self.peak - self.min_lr) * (1.0 - math.sqrt(frac)))
        return lr

    @classmethod
    def from_config(cls, optim_cfg: Optim, *, peak: float, steps: int) -> WSDSchedule:
        """Build from ``trainer.optim`` (``warmup_steps``, ``cooldown_frac``, ``min_lr``)."""
        return cls(
            peak=peak,
            steps=steps,
            warmup_steps=optim_cfg.warmup_steps,
            cooldown_frac=optim_cfg.cooldown_frac,
            min_lr=optim_cfg.min_lr,
        )


def build_scheduler(optimizer: torch.optim.Optimizer, schedule: WSDSchedule) -> torch.optim.lr_scheduler.LambdaLR:
    """``LambdaLR`` whose factor is ``schedule``'s absolute learning rate (the optimizer's base lr
    is 1). Its epoch counts finished updates, so update ``t`` runs at ``schedule(t)``; the
    trainer steps it after every optimizer step (a skipped update too)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda updates_done: schedule(updates_done + 1))
