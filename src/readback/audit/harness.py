"""What every audited op needs: small seeded inputs, one backward with taps, a hand rounding, and
the hand-written derivatives of the activations (candidates are computed in float64)."""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from readback.audit.core import TOL
from readback.numerics import E4M3, QTensor, compute_scale, quantize

F64 = torch.float64


@dataclass(frozen=True)
class Setup:
    """Shapes and seed of one audit: B, H query heads, G KV groups, T, head dim."""

    seed: int = 0
    batch: int = 2
    heads: int = 4
    groups: int = 2
    seq: int = 16
    head_dim: int = 16
    tol: float = TOL
    softmax_scale: float = 0.125

    @property
    def width(self) -> int:
        return self.heads * self.head_dim

    def generator(self, name: str) -> torch.Generator:
        """A generator per audited op, so each op's inputs do not depend on which others ran."""
        return torch.Generator().manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))

    @staticmethod
    def randn(generator: torch.Generator, *shape: int, std: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * std

    def attention_inputs(self, generator: torch.Generator) -> dict[str, torch.Tensor]:
        """q (B, H, T, hd), k and v (B, G, T, hd), an output projection and its upstream gradient."""
        b, h, grp, t, hd, d = self.batch, self.heads, self.groups, self.seq, self.head_dim, self.width
        return {
            "q": self.randn(generator, b, h, t, hd, std=2.0),
            "k": self.randn(generator, b, grp, t, hd, std=2.0),
            "v": self.randn(generator, b, grp, t, hd),
            "w_proj": self.randn(generator, d, d, std=d**-0.5),
            "upstream": self.randn(generator, b, t, d),
        }


def backprop(
    forward: Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]],
    inputs: dict[str, torch.Tensor],
    upstream: torch.Tensor,
    dtype: torch.dtype,
) -> dict[str, torch.Tensor]:
    """Run ``forward(**inputs)`` on leaves of ``dtype``, backpropagate ``upstream``, and return the
    gradient of every input and of every tap (the intermediates ``forward`` returns by name, whose
    gradient is what the backward of the op that produced them received), and the taps' values
    under ``"<tap>.value"``."""
    leaves = {name: t.detach().to(dtype).requires_grad_() for name, t in inputs.items()}
    out, taps = forward(**leaves)
    for tap in taps.values():
        tap.retain_grad()
    out.backward(upstream.to(out.dtype))
    grads = {name: leaf.grad for name, leaf in leaves.items() if leaf.grad is not None}
    grads.update({name: tap.grad for name, tap in taps.items() if tap.grad is not None})
    grads.update({f"{name}.value": tap.detach() for name, tap in taps.items()})
    return grads


def round_fp8(x: torch.Tensor, fmt=E4M3) -> QTensor:
    """``x`` rounded to nearest on the FP8 grid with a current (per-tensor amax) scale."""
    x = x.detach().float()
    return quantize(x, fmt, compute_scale(x.abs().amax(), fmt))


def value(t: QTensor | torch.Tensor) -> torch.Tensor:
    """Real values in float64."""
    return t.dequantize(F64) if isinstance(t, QTensor) else t.detach().to(F64)


def gelu_slope(x: torch.Tensor) -> torch.Tensor:
    """d gelu(x) / dx = Phi(x) + x phi(x) (exact, erf form)."""
    x = x.to(F64)
    return 0.5 * (1 + torch.erf(x / math.sqrt(2))) + x * torch.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


XIELU_BETA, XIELU_EPS = 0.5, -1e-6


def xielu(x: torch.Tensor, alpha_p: float, alpha_n: float) -> torch.Tensor:
    """xIELU as plain torch (autograd does its backward)."""
    negative = alpha_n * torch.expm1(torch.clamp(x, max=XIELU_EPS)) - alpha_n * x
    return torch.where(x > 0, alpha_p * x * x, negative) + XIELU_BETA * x


def xielu_slope(x: torch.Tensor, alpha_p: float, alpha_n: float) -> torch.Tensor:
    """d xielu(x) / dx, by hand."""
    x = x.to(F64)
    negative = alpha_n * torch.where(x < XIELU_EPS, torch.exp(x), torch.zeros_like(x)) - alpha_n
    return torch.where(x > 0, 2 * alpha_p * x, negative) + XIELU_BETA


def heads(t: torch.Tensor, batch: int, seq: int, n_heads: int) -> torch.Tensor:
    """(B, T, H*hd) -> (B, H, T, hd)."""
    return t.reshape(batch, seq, n_heads, -1).transpose(1, 2)


def group_sum(t: torch.Tensor, groups: int) -> torch.Tensor:
    """Per-head gradients (B, H, T, hd) summed into the G shared KV groups."""
    batch, n_heads, seq, dim = t.shape
    return t.reshape(batch, groups, n_heads // groups, seq, dim).sum(2)


def expand_groups(t: torch.Tensor, n_heads: int) -> torch.Tensor:
    """KV groups (B, G, T, hd) repeated for the query heads that share them."""
    return t.repeat_interleave(n_heads // t.shape[1], dim=1)


def causal_softmax(scores: torch.Tensor) -> torch.Tensor:
    seq = scores.shape[-1]
    mask = torch.ones(seq, seq, dtype=torch.bool, device=scores.device).triu(1)
    return torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)


def attention_grads(
    p: torch.Tensor,
    d_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o_read: torch.Tensor | None,
    scale: float,
    groups: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dQ, dK)`` of causal attention by hand, with the softmax backward reading ``p`` and the
    D-term reading ``o_read`` (``rowsum(dO * o_read)``), or nothing (``rowsum(p * dP)``) when None.
    All (B, H, T, hd) except ``p`` (B, H, T, T); K and V already expanded to H heads."""
    d_p = d_out @ v.mT
    row_term = (d_out * o_read if o_read is not None else p * d_p).sum(-1, keepdim=True)
    d_s = p * (d_p - row_term)
    return scale * d_s @ k, group_sum(scale * d_s.mT @ q, groups)


def grad_of(t: torch.Tensor) -> torch.Tensor:
    """``t.grad``, which the backward just run must have filled."""
    if t.grad is None:
        raise RuntimeError("the backward left no gradient here")
    return t.grad
