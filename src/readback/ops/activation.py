"""xIELU, FOG's activation: ``a_p x^2 + b x`` for ``x > 0``, ``a_n expm1(min(x, eps)) - a_n x + b x``
otherwise (``b = 0.5``, ``eps = -1e-6``; ``a_p``, ``a_n`` learnable scalars). Not rounded itself:
its output is rounded by the next linear."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch

from readback.numerics.spec import frozen_reads
from readback.policy import POLICIES

if TYPE_CHECKING:
    from readback.numerics.state import Numerics

BETA = 0.5
EPS = -1e-6

# The input gradient reads the high-precision input the forward evaluated (nothing is rounded here).
READS = frozen_reads({policy: {"dx": "original"} for policy in POLICIES})


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
        """The slope ``2 a_p max(x, 0) + s_n [x <= 0] + b``, ``s_n = a_n e^x [x < eps] - a_n``, and
        the coefficients' gradients, as the reference formula blends them, in place."""
        x, alpha_p, alpha_n = fctx.saved_tensors
        expm1 = torch.clamp(x, max=EPS).expm1_()
        negative = torch.le(x, 0, out=torch.empty_like(x))
        slope = torch.add(expm1, 1).mul_(torch.lt(x, EPS, out=torch.empty_like(x))).mul_(alpha_n).sub_(alpha_n)
        slope.mul_(negative)
        x_positive = x.clamp(min=0)
        dx = slope.add_(x_positive * (2 * alpha_p)).add_(BETA).mul_(dy)
        d_alpha_p = x_positive.mul_(x_positive).mul_(dy).sum().reshape(alpha_p.shape)
        d_alpha_n = expm1.sub_(x.clamp(max=0)).mul_(negative).mul_(dy).sum().reshape(alpha_n.shape)
        return dx, d_alpha_p, d_alpha_n, None


def _forward(x: torch.Tensor, alpha_p: torch.Tensor, alpha_n: torch.Tensor) -> torch.Tensor:
    """``replay``'s value, bit for bit (the same operations in the same order), in place on two
    buffers: a fifth of its time on the CPU, where fresh temporaries and passes dominate."""
    buffer = x.clamp(min=0)
    out = (buffer * alpha_p).mul_(buffer)
    negative_branch = torch.clamp(x, max=EPS).expm1_().mul_(alpha_n)
    negative_branch.sub_(torch.clamp(x, max=0, out=buffer).mul_(alpha_n))
    negative_branch.mul_(torch.le(x, 0, out=buffer))
    return out.add_(negative_branch).add_(torch.mul(x, BETA, out=negative_branch))


def _branches(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``max(x, 0)``, ``min(x, 0)`` and the mask ``x <= 0`` (0/1 in ``x``'s dtype).

    The positive branch, evaluated on ``max(x, 0)``, is exactly 0 where ``x <= 0``; the negative
    branch, evaluated on ``min(x, 0)``, stays finite where ``x > 0`` and is multiplied by the
    mask. Their sum is what ``torch.where`` selects (up to the sign of a zero), several times
    faster on the CPU (``where`` and ``masked_fill`` cost eight multiplies each there).
    """
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
