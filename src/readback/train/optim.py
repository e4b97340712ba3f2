"""AdamW with the FOG recipe and its learning rate schedule, gradient norm/clipping and the
non-finite gradient check.

The schedule is warmup-stable-decay with a 1-sqrt cooldown (the FOG recipe). Steps are counted
from 1: ``lr(t)`` is the learning rate of the ``t``-th optimizer update, the one after which the
trainer's step counter reads ``t`` (and which is logged as ``step=t``).

* warmup, ``t <= warmup_steps``: ``peak * t / warmup_steps`` (linear, never 0);
* stable: ``peak``;
* cooldown over the last ``cooldown_frac`` of the ``T`` steps, from ``t0 = T - round(cooldown_frac * T)``:
  ``min_lr + (peak - min_lr) * (1 - sqrt((t - t0) / (T - t0)))``, which reaches ``min_lr`` at ``t = T``.

When warmup and cooldown overlap (very short runs) the smaller of the two values is used.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from readback.train.settings import Optim


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Split the trainable parameters into a decayed and a non-decayed AdamW group.

    Weight decay applies only to parameters with two or more dimensions (GEMM weights and
    embeddings). One-dimensional parameters and scalars -- RMSNorm gains, biases, the learnable
    xIELU scalars -- get **no weight decay**. Frozen parameters (``requires_grad=False``, e.g. the
    QK-norm gains of FOG) are left out of the optimizer entirely.
    """
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": float(weight_decay)}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def build_optimizer(model: nn.Module, optim_cfg: Optim) -> torch.optim.AdamW:
    """AdamW over :func:`param_groups` with ``trainer.optim`` betas, eps and weight decay.

    Its base learning rate is 1: the schedule (:func:`build_scheduler`)
    gives absolute learning rates as the ``LambdaLR`` factor, so ``lr = 1.0 * schedule(t)``
    holds exactly.
    """
    beta1, beta2 = optim_cfg.betas  # two, checked by the schema
    return torch.optim.AdamW(
        param_groups(model, optim_cfg.weight_decay),
        lr=1.0,
        betas=(beta1, beta2),
        eps=optim_cfg.eps,
    )


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


def _full(grad: torch.Tensor) -> torch.Tensor:
    """A gradient whole: FSDP's are ``DTensor`` shards (``full_tensor`` gathers: every rank calls it)."""
    return grad.full_tensor() if isinstance(grad, DTensor) else grad


def clip_gradients(params: Sequence[torch.Tensor], max_norm: float) -> torch.Tensor:
    """The pre-clip global L2 norm of all gradients (a plain fp32 scalar on every rank, ``inf`` or
    ``nan`` if any gradient is); when it is finite and ``max_norm > 0``, the gradients are scaled by
    ``min(1, max_norm / (norm + 1e-6))`` (``torch.nn.utils.clip_grads_with_norm_``)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    norm = _full(torch.nn.utils.get_total_norm(grads, norm_type=2.0))
    if max_norm > 0 and bool(torch.isfinite(norm)):
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


def nonfinite_grad_names(named_params: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """Names of the parameters whose gradient holds a NaN or an Inf (the same on every rank)."""
    return [name for name, p in named_params if p.grad is not None and not bool(torch.isfinite(_full(p.grad)).all())]
