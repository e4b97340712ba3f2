"""FOG ("fast and outlier-guarded"): a transformer made to train with FP8 everywhere.

No pre-norm: each sub-block's output is RMS-normalised (gain initialised to 1/sqrt(n_layers))
before the residual add; QK RMSNorm with frozen gains; softmax scale 0.125; embeddings x50; no
final norm; xIELU; GQA; RoPE base 500000; no biases. Every GEMM and the attention core are
readback ops, so the run's ``Numerics`` (precision, policy, rounding) reaches every rounding site.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from readback.ops.activation import BETA, xielu
from readback.ops.attention import attention
from readback.ops.context import Numerics
from readback.ops.linear import linear
from readback.ops.norm import rms_norm


# The ops of a block that round (their sites are ``{owner}.input``, ``.weight``, ``.q``, ...).
BLOCK_ROUNDING_OPS = ("attn.qkv", "attn.core", "attn.proj", "mlp.up", "mlp.down")


def rounding_owners(n_layers: int) -> list[str]:
    """Names of the ops that own the model's rounding sites, the names ``precision.bf16_layers``
    entries match (as name prefixes, the rule ``Numerics`` uses)."""
    return [f"layers.{i}.{op}" for i in range(n_layers) for op in BLOCK_ROUNDING_OPS] + ["lm_head"]


@dataclass(frozen=True)
class FOGConfig:
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_groups: int
    ffn_dim: int
    vocab_size: int
    seq_len: int
    tied: bool = True
    softmax_scale: float = 0.125
    embedding_multiplier: float = 50.0
    rope_base: float = 500000.0
    init_std: float = 0.02
    norm_eps: float = 1e-6

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


class Linear(nn.Module):
    """A bias-free linear whose GEMM rounds at sites ``{name}.input/.weight/.grad_output``."""

    def __init__(self, d_in: int, d_out: int, name: str, numerics: Numerics, std: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(d_out, d_in))
        nn.init.normal_(self.weight, std=std)
        self.name, self.numerics = name, numerics

    def forward(self, x, x_q=None):
        return linear(x, self.weight, self.numerics, self.name, x_q)


class PostNorm(nn.Module):
    """RMSNorm of a sub-block's output before the residual add; gain starts at 1/sqrt(n_layers)."""

    def __init__(self, dim: int, n_layers: int, name: str, numerics: Numerics, eps: float):
        super().__init__()
        self.gain = nn.Parameter(torch.full((dim,), 1 / math.sqrt(n_layers)))
        self.name, self.numerics, self.eps = name, numerics, eps

    def forward(self, x):
        return rms_norm(x, self.gain, self.numerics, self.name, self.eps)


class XIELU(nn.Module):
    """xIELU with learnable ``alpha_p = softplus(p)`` and ``alpha_n = beta + softplus(n)``, both 0.8 at init."""

    def __init__(self, numerics: Numerics):
        super().__init__()
        inverse_softplus = lambda y: math.log(math.expm1(y))  # noqa: E731
        self.p = nn.Parameter(torch.tensor(inverse_softplus(0.8)))
        self.n = nn.Parameter(torch.tensor(inverse_softplus(0.8 - BETA)))
        self.numerics = numerics

    def forward(self, x):
        return xielu(x, F.softplus(self.p), BETA + F.softplus(self.n), self.numerics)


def rope(x: torch.Tensor, base: float) -> torch.Tensor:
    """Rotary position embedding over the last dimension of ``x`` (B, heads, T, hd)."""
    seq, dim = x.shape[-2], x.shape[-1]
    inv_freq = base ** (-torch.arange(0, dim, 2, device=x.device, dtype=torch.float64) / dim)
    angles = torch.outer(torch.arange(seq, device=x.device, dtype=torch.float64), inv_freq)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, cfg: FOGConfig, name: str, numerics: Numerics):
        super().__init__()
        self.cfg, self.name, self.numerics = cfg, name, numerics
        hd = cfg.head_dim
        self.qkv = Linear(cfg.d_model, (cfg.n_heads + 2 * cfg.n_kv_groups) * hd, f"{name}.qkv", numerics, cfg.init_std)
        self.proj = Linear(cfg.n_heads * hd, cfg.d_model, f"{name}.proj", numerics, cfg.init_std)
        self.register_buffer("qk_gain", torch.ones(hd), persistent=False)  # frozen QK-norm gains

    def forward(self, x):
        cfg, batch, seq = self.cfg, x.shape[0], x.shape[1]
        q, k, v = self.qkv(x).split([cfg.n_heads * cfg.head_dim, *[cfg.n_kv_groups * cfg.head_dim] * 2], dim=-1)
        q, k, v = (t.reshape(batch, seq, -1, cfg.head_dim).transpose(1, 2) for t in (q, k, v))
        q = rope(rms_norm(q, self.qk_gain, self.numerics, f"{self.name}.q_norm", cfg.norm_eps), cfg.rope_base)
        k = rope(rms_norm(k, self.qk_gain, self.numerics, f"{self.name}.k_norm", cfg.norm_eps), cfg.rope_base)
        o, oq = attention(q, k, v, self.numerics, f"{self.name}.core", cfg.softmax_scale)
        return self.proj(o, x_q=oq), o


class MLP(nn.Module):
    def __init__(self, cfg: FOGConfig, name: str, numerics: Numerics):
        super().__init__()
        self.up = Linear(cfg.d_model, cfg.ffn_dim, f"{name}.up", numerics, cfg.init_std)
        self.act = XIELU(numerics)
        self.down = Linear(cfg.ffn_dim, cfg.d_model, f"{name}.down", numerics, cfg.init_std)

    def forward(self, x):
        return self.down(self.act(self.up(x)))


class Block(nn.Module):
    def __init__(self, cfg: FOGConfig, index: int, numerics: Numerics):
        super().__init__()
        name = f"layers.{index}"
        self.attn = Attention(cfg, f"{name}.attn", numerics)
        self.attn_norm = PostNorm(cfg.d_model, cfg.n_layers, f"{name}.attn_norm", numerics, cfg.norm_eps)
        self.mlp = MLP(cfg, f"{name}.mlp", numerics)
        self.mlp_norm = PostNorm(cfg.d_model, cfg.n_layers, f"{name}.mlp_norm", numerics, cfg.norm_eps)

    def forward(self, x, stats: dict | None = None):
        attn_out, core_out = self.attn(x)
        x = x + self.attn_norm(attn_out)
        if stats is not None:
            stats.setdefault("attn_out", []).append(kurtosis(core_out))
            stats.setdefault("ffn_in", []).append(kurtosis(x))
        return x + self.mlp_norm(self.mlp(x))


def rounding_sites(n_layers: int) -> list[str]:
    """Names of the sites a training step of FOG rounds at (forward and backward), in model
    order; config checks match site patterns against them without building the model."""
    names = []
    for i in range(n_layers):
        attn, mlp = f"layers.{i}.attn", f"layers.{i}.mlp"
        names += [f"{attn}.qkv.{s}" for s in ("input", "weight", "grad_output")]
        names += [f"{attn}.core.{s}" for s in ("q", "k", "v", "probs", "output", "grad_output", "grad_scores")]
        names += [f"{attn}.proj.{s}" for s in ("weight", "grad_output")]  # its input is the core's output
        names += [f"{mlp}.{lin}.{s}" for lin in ("up", "down") for s in ("input", "weight", "grad_output")]
    return names + [f"lm_head.{s}" for s in ("input", "weight", "grad_output")]


def kurtosis(x: torch.Tensor) -> float:
    """Kurtosis over the hidden dimension, averaged over tokens: large when a few channels
    carry outliers, the FOG paper's early sign of FP8 divergence (3 for a Gaussian)."""
    x = x.detach().float()
    centered = x - x.mean(-1, keepdim=True)
    var = centered.pow(2).mean(-1)
    return (centered.pow(4).mean(-1) / var.clamp_min(1e-30).pow(2)).mean().item()


class FOG(nn.Module):
    def __init__(self, cfg: FOGConfig, numerics: Numerics):
        super().__init__()
        self.cfg, self.numerics = cfg, numerics
        self.embedding = nn.Parameter(torch.empty(cfg.vocab_size, cfg.d_model))
        nn.init.normal_(self.embedding, std=cfg.init_std)
        self.layers = nn.ModuleList(Block(cfg, i, numerics) for i in range(cfg.n_layers))
        self.lm_head = None if cfg.tied else Linear(cfg.d_model, cfg.vocab_size, "lm_head", numerics, cfg.init_std)
        self.track_stats = False
        self._stats: dict[str, float] = {}

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy (FP32) of ``idx`` against ``targets``, both (B, T)."""
        x = F.embedding(idx, self.embedding).to(self.numerics.dtype) * self.cfg.embedding_multiplier
        stats = {} if self.track_stats else None
        self.numerics.mechanism = self.track_stats  # attention's logit/entropy/D-term statistics too
        for block in self.layers:
            x = block(x, stats)
        if stats is not None:
            self._stats = {f"kurtosis/{k}_max": max(v) for k, v in stats.items()}
        logits = linear(x, self.embedding, self.numerics, "lm_head") if self.lm_head is None else self.lm_head(x)
        return F.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)).flatten(0, 1), targets.flatten())

    def activation_stats(self) -> dict[str, float]:
        """Kurtosis maxima over layers from the last forward run with ``track_stats`` on."""
        return dict(self._stats)

    def n_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6 per GEMM weight (the tied LM head included), plus the
        attention score and value products (causal: half of 12 * layers * seq * width)."""
        cfg = self.cfg
        gemm_weights = sum(m.weight.numel() for m in self.modules() if isinstance(m, Linear))
        gemm_weights += self.embedding.numel() if self.lm_head is None else 0
        return 6 * gemm_weights + 6 * cfg.n_layers * cfg.seq_len * cfg.n_heads * cfg.head_dim
