"""Peers of readback in plain PyTorch, for ``benchmarks/step.py``: a GPT with FOG's dimensions,
and FOG itself without readback's numerics.

``plain_fog`` separates what FOG's architecture costs from what the emulation costs: the same
blocks (RMSNorm, QK norms, RoPE, xIELU, GQA, tied head) in FP32, with ``nn.Linear``, torch's
``rms_norm`` and ``scaled_dot_product_attention``, and xIELU's reference formula; nothing is
rounded, scaled or counted.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from readback.model.fog import FOG, XIELU, FOGConfig, Linear, Parts, RMSNorm
from readback.ops.activation import BETA, replay


class PlainBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        hd = c.head_dim
        self.norm1, self.norm2 = nn.LayerNorm(c.d_model, bias=False), nn.LayerNorm(c.d_model, bias=False)
        self.qkv = nn.Linear(c.d_model, (c.n_heads + 2 * c.n_kv_groups) * hd, bias=False)
        self.proj = nn.Linear(c.n_heads * hd, c.d_model, bias=False)
        self.up, self.down = nn.Linear(c.d_model, c.ffn_dim, bias=False), nn.Linear(c.ffn_dim, c.d_model, bias=False)

    def forward(self, x):
        c, (batch, seq, _) = self.c, x.shape
        q, k, v = self.qkv(self.norm1(x)).split([c.n_heads * c.head_dim, *[c.n_kv_groups * c.head_dim] * 2], -1)
        q, k, v = (t.view(batch, seq, -1, c.head_dim).transpose(1, 2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.proj(o.transpose(1, 2).reshape(batch, seq, -1))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class PlainGPT(nn.Module):
    """A pre-norm GPT with FOG's dimensions, for the throughput comparison."""

    def __init__(self, c):
        super().__init__()
        self.embedding = nn.Embedding(c.vocab_size, c.d_model)
        self.position = nn.Embedding(c.seq_len, c.d_model)
        self.layers = nn.ModuleList(PlainBlock(c) for _ in range(c.n_layers))
        self.norm = nn.LayerNorm(c.d_model, bias=False)

    def forward(self, idx, targets):
        x = self.embedding(idx) + self.position(torch.arange(idx.shape[1]))
        for layer in self.layers:
            x = layer(x)
        logits = self.norm(x) @ self.embedding.weight.t()  # tied
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


class _Linear(Linear):
    def forward(self, x, x_q=None):
        return F.linear(x, self.weight)


class _RMSNorm(RMSNorm):
    def forward(self, x):
        return F.rms_norm(x, self.gain.shape, self.gain, self.eps)


class _XIELU(XIELU):
    def forward(self, x):
        return replay(x, F.softplus(self.p), BETA + F.softplus(self.n))


class _Attention(nn.Module):
    def __init__(self, softmax_scale: float):
        super().__init__()
        self.scale = softmax_scale

    def forward(self, q, k, v):
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=True)
        return o.transpose(1, 2).flatten(2), None


class PlainParts(Parts):
    """FOG's modules, built as FOG builds them, running plain FP32 PyTorch (their sites and
    ``numerics`` are held, not used)."""

    def linear(self, d_in, d_out, name, std):
        return _Linear(d_in, d_out, name, self.numerics, std)

    def norm(self, dim, gain, name, eps, frozen=False):
        return _RMSNorm(dim, gain, name, self.numerics, eps, frozen)

    def attention_core(self, cfg, name, index):
        return _Attention(cfg.softmax_scale)

    def activation(self):
        return _XIELU(self.numerics)

    def tied_head(self, x, embedding):
        return x @ embedding.t()

    @property
    def residual_dtype(self):
        return torch.float32


def plain_fog(cfg: FOGConfig, numerics) -> FOG:
    """FOG of ``cfg`` on ``PlainParts`` (``numerics`` is held, not used)."""
    return FOG(cfg, numerics, PlainParts(numerics))
