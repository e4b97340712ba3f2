"""xIELU, FOG's activation: ``a_p x^2 + b x`` for ``x > 0``, ``a_n expm1(min(x, eps)) - a_n x + b x``
otherwise (``b = 0.5``, ``eps = -1e-6``; ``a_p``, ``a_n`` learnable scalars). Not rounded itself:
its output is rounded by the next linear."""

from __future__ import annotations

import torch

from readback.policy import POLICIES

BETA = 0.5
EPS = -1e-6

# The input gradient reads the high-precision input the forward evaluated (nothing is rounded here).
READS = {policy: {"dx": "original"} for policy in POLICIES}


class _XIELU(torch.autograd.Function):
    @staticmethod
    def forward(fctx, x, alpha_p, alpha_n, numerics):
        fctx.save_for_backward(x, alpha_p, alpha_n)
        numerics.account("xielu", input=x)
        return replay(x, alpha_p, alpha_n)

    @staticmethod
    def backward(fctx, dy):
        x, alpha_p, alpha_n = fctx.saved_tensors
        positive = x > 0
        expm1 = torch.expm1(torch.clamp(x, max=EPS))
        slope_negative = alpha_n * torch.where(x < EPS, expm1 + 1, torch.zeros_like(x)) - alpha_n
        dx = dy * (torch.where(positive, 2 * alpha_p * x, slope_negative) + BETA)
        d_alpha_p = (dy * torch.where(positive, x * x, torch.zeros_like(x))).sum().reshape(alpha_p.shape)
        d_alpha_n = (dy * torch.where(positive, torch.zeros_like(x), expm1 - x)).sum().reshape(alpha_n.shape)
        return dx, d_alpha_p, d_alpha_n, None


def replay(x: torch.Tensor, alpha_p: torch.Tensor, alpha_n: torch.Tensor) -> torch.Tensor:
    """Reference: the formula in plain torch ops, differentiated by autograd (nothing rounded)."""
    negative = alpha_n * torch.expm1(torch.clamp(x, max=EPS)) - alpha_n * x
    return torch.where(x > 0, alpha_p * x * x, negative) + BETA * x


def xielu(x: torch.Tensor, alpha_p: torch.Tensor, alpha_n: torch.Tensor, numerics) -> torch.Tensor:
    """xIELU with the effective coefficients ``alpha_p = softplus(p)``, ``alpha_n = b + softplus(n)``."""
    if numerics.replaying:
        dtype = numerics.dtype
        return replay(x.to(dtype), alpha_p.to(dtype), alpha_n.to(dtype))
    return _XIELU.apply(x, alpha_p, alpha_n, numerics)
