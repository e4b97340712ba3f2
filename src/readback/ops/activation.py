"""xIELU, FOG's activation: ``a_p x^2 + b x`` for ``x > 0``, ``a_n expm1(min(x, eps)) - a_n x + b x``
otherwise (``b = 0.5``, ``eps = -1e-6``; ``a_p``, ``a_n`` learnable scalars). Not rounded itself:
its output is rounded by the next linear."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch

from readback.policy import POLICIES

if TYPE_CHECKING:
    from readback.ops.numerics import Numerics

BETA = 0.5
EPS = -1e-6

# The input gradient reads the high-precision input the forward evaluated (nothing is rounded here).
READS = {policy: {"dx": "original"} for policy in POLICIES}


class _XIELU(torch.autograd.Function):
    @staticmethod
    def forward(
        fctx: Any, x: torch.Tensor, alpha_p: torch.Tensor, alpha_n: torch.Tensor, numerics: Numerics
    ) -> torch.Tensor:
        fctx.save_for_backward(x, alpha_p, alpha_n)
        numerics.account("xielu", input=x)
        return _forward(x, alpha_p, alpha_n)

    @staticmethod
    def backward(fctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, alpha_p, alpha_n = fctx.saved_tensors
        positive = x > 0
        expm1 = torch.expm1(torch.clamp(x, max=EPS))
        # slope a_n (e^x - 1) + a_n - a_n = a_n e^x - a_n below EPS, -a_n from EPS to 0 (NaN stays NaN)
        slope_negative = (expm1 + 1).masked_fill_(x >= EPS, 0.0).mul_(alpha_n).sub_(alpha_n)
        dx = torch.where(positive, x * (2 * alpha_p), slope_negative).add_(BETA).mul_(dy)
        x_positive = x.clamp(min=0)
        d_alpha_p = x_positive.mul_(x_positive).mul_(dy).sum().reshape(alpha_p.shape)
        # (expm1 - min(x, 0)) times the mask x <= 0, which is -0 where x > 0 (expm1(EPS) < 0)
        d_alpha_n = (expm1 - x).masked_fill_(positive, -0.0).mul_(dy).sum().reshape(alpha_n.shape)
        return dx, d_alpha_p, d_alpha_n, None


def _forward(x: torch.Tensor, alpha_p: torch.Tensor, alpha_n: torch.Tensor) -> torch.Tensor:
    """``replay``'s value, bit for bit, with each branch evaluated once and selected by
    ``torch.where``, in place where it can: half the passes over ``x`` and fewer temporaries.
    (``replay`` adds ``a_p max(x, 0)^2`` and the masked negative branch; one of the two is a
    zero there, and adding a zero to the other changes no bit.)"""
    half = x * BETA
    positive = (x * alpha_p).mul_(x).add_(half)
    negative = torch.clamp(x, max=EPS).expm1_().mul_(alpha_n).sub_(x.clamp(max=0).mul_(alpha_n)).add_(half)
    return torch.where(x > 0, positive, negative)


def _branches(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``max(x, 0)``, ``min(x, 0)`` and the mask ``x <= 0`` (0/1 in ``x``'s dtype): the
    reference formula's branches, each finite where the other one is selected."""
    return x.clamp(min=0), x.clamp(max=0), (x <= 0).to(x.dtype)


def replay(x: torch.Tensor, alpha_p: torch.Tensor, alpha_n: torch.Tensor) -> torch.Tensor:
    """Reference: the formula in plain torch ops, differentiated by autograd (nothing rounded)."""
    x_positive, x_negative, negative = _branches(x)
    negative_branch = alpha_n * torch.expm1(torch.clamp(x, max=EPS)) - alpha_n * x_negative
    return alpha_p * x_positive * x_positive + negative_branch * negative + BETA * x


def xielu(x: torch.Tensor, alpha_p: torch.Tensor, alpha_n: torch.Tensor, numerics: Numerics) -> torch.Tensor:
    """xIELU with the effective coefficients ``alpha_p = softplus(p)``, ``alpha_n = b + softplus(n)``."""
    if numerics.replaying:
        dtype = numerics.dtype
        return replay(x.to(dtype), alpha_p.to(dtype), alpha_n.to(dtype))
    return cast(torch.Tensor, _XIELU.apply(x, alpha_p, alpha_n, numerics))  # type: ignore[no-untyped-call]  # torch leaves apply untyped
