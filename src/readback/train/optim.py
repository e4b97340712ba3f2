"""AdamW with the FOG recipe, gradient norm/clipping and the non-finite gradient check."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Split the trainable parameters into a decayed and a non-decayed AdamW group.

    Weight decay applies only to parameters with two or more dimensions (GEMM weights and
    embeddings). One-dimensional parameters and scalars -- RMSNorm gains, biases, the learnable
    xIELU scalars -- get **no weight decay**. Frozen parameters (``requires_grad=False``, e.g. the
    QK-norm gains of FOG) are left out of the optimizer entirely.
    """
    decay, no_decay = [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": float(weight_decay)}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def build_optimizer(model: nn.Module, optim_cfg: Any, lr: float) -> torch.optim.AdamW:
    """AdamW over :func:`param_groups` with ``trainer.optim`` betas, eps and weight decay.

    The learning rate is set by the trainer before every step from the schedule; ``lr`` is only
    the initial value.
    """
    return torch.optim.AdamW(
        param_groups(model, optim_cfg.weight_decay),
        lr=lr,
        betas=tuple(optim_cfg.betas),  # type: ignore[arg-type]
        eps=optim_cfg.eps,
    )


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def grad_norm(params: Iterable[torch.Tensor]) -> torch.Tensor:
    """Global L2 norm of all gradients (fp32 scalar); ``inf``/``nan`` if any gradient is."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    norms = [torch.linalg.vector_norm(g.detach(), dtype=torch.float32) for g in grads]
    device = norms[0].device
    return torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]))


def clip_grads_(params: Iterable[torch.Tensor], max_norm: float, total_norm: torch.Tensor) -> None:
    """Scale gradients in place so that their global norm is at most ``max_norm``.

    Same rule as ``torch.nn.utils.clip_grad_norm_`` (``coef = max_norm / (norm + 1e-6)``,
    clamped to 1), given the already computed pre-clip ``total_norm``. ``max_norm <= 0`` disables.
    """
    if max_norm is None or max_norm <= 0:
        return
    coef = torch.clamp(float(max_norm) / (total_norm + 1e-6), max=1.0)
    for p in params:
        if p.grad is not None:
            p.grad.detach().mul_(coef.to(p.grad.device, p.grad.dtype))


def nonfinite_grad_names(named_params: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """Names of the parameters whose gradient holds a NaN or an Inf."""
    return [
        name
        for name, p in named_params
        if p.grad is not None and not bool(torch.isfinite(p.grad).all())
    ]
