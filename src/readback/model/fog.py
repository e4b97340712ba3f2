"""FOG ("fast and outlier-guarded"): a transformer made to train with FP8 everywhere.

No pre-norm: each sub-block's output is RMS-normalised (gain initialised to 1/sqrt(n_layers))
before the residual add; QK RMSNorm with frozen gains; softmax scale 0.125; embeddings x50; no
final norm; xIELU; GQA; RoPE base 500000; no biases.

There is one FOG. It takes its linear, norm, attention-core and activation modules from a
``Parts`` object (the way torchtitan's float8 converter swaps modules): ``Parts`` itself gives
readback's ops, so the run's ``Numerics`` (precision, policy, rounding) reaches every rounding
site; ``readback.backends.te.parts.TEParts`` gives Transformer Engine modules where TE can run them.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from readback.model.settings import Sizes, size
from readback.numerics.state import Numerics
from readback.ops import attention as attention_op
from readback.ops import linear as linear_op
from readback.ops.activation import BETA, xielu
from readback.ops.attention import attention
from readback.ops.linear import linear
from readback.ops.norm import rms_norm

# The ops of a block that round (their sites are ``{owner}.input``, ``.weight``, ``.q``, ...).
BLOCK_ROUNDING_OPS = ("attn.qkv", "attn.core", "attn.proj", "mlp.up", "mlp.down")


def rounding_owners(n_layers: int) -> list[str]:
    """Names of the ops that own the model's rounding sites, the names ``precision.bf16_layers``
    entries match (as name prefixes, the rule ``Numerics`` uses)."""
    return [f"layers.{i}.{op}" for i in range(n_layers) for op in BLOCK_ROUNDING_OPS] + ["lm_head"]


# the sites each rounding op owns, as the ops name them; the projection's input is the core's
# output, rounded there
_OP_SITES = {
    "attn.qkv": linear_op.SITES,
    "attn.core": attention_op.SITES,
    "attn.proj": tuple(site for site in linear_op.SITES if site != "input"),
    "mlp.up": linear_op.SITES,
    "mlp.down": linear_op.SITES,
    "lm_head": linear_op.SITES,
}


def rounding_sites(n_layers: int) -> list[str]:
    """Names of the sites a training step of FOG rounds at (forward and backward), in model
    order; config checks match site patterns against them without building the model."""
    return [
        f"{owner}.{site}"
        for owner in rounding_owners(n_layers)
        for site in _OP_SITES[owner.split(".", 2)[-1] if owner.startswith("layers.") else owner]
    ]


def is_gradient_site(site: str) -> bool:
    """Whether ``site`` rounds a gradient (the recipe's backward format, E5M2 under HYBRID) rather
    than an activation or weight (the forward format, E4M3)."""
    return site.rsplit(".", 1)[-1] in linear_op.GRADIENT_SITES + attention_op.GRADIENT_SITES


@dataclass
class FOGConfig(Sizes):
    """The FOG's ``Sizes`` (the schema's, ``fog_config``) and its architecture's constants."""

    vocab_size: int = size()  # resolved: a run's null is its data's vocabulary by the time a model is built
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
    """A bias-free linear whose GEMM rounds at sites ``{name}.input/.weight/.grad_output``;
    ``x_q`` is a rounded copy of ``x`` made upstream, multiplied as is (the attention's O8)."""

    def __init__(self, d_in: int, d_out: int, name: str, numerics: Numerics, std: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(d_out, d_in))
        nn.init.normal_(self.weight, std=std)
        self.name, self.numerics = name, numerics

    def forward(self, x, x_q=None):
        return linear(x, self.weight, self.numerics, self.name, x_q)


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension; a ``frozen`` gain is a constant buffer, not a parameter."""

    def __init__(self, dim: int, gain: float, name: str, numerics: Numerics, eps: float, frozen: bool = False):
        super().__init__()
        if frozen:
            self.register_buffer("gain", torch.full((dim,), gain), persistent=False)
        else:
            self.gain = nn.Parameter(torch.full((dim,), gain))
        self.name, self.numerics, self.eps = name, numerics, eps

    def forward(self, x):
        return rms_norm(x, self.gain, self.numerics, self.name, self.eps)


class XIELU(nn.Module):
    """xIELU with learnable ``alpha_p = softplus(p)`` and ``alpha_n = beta + softplus(n)``, both 0.8 at init.
    ``p`` and ``n`` have shape ``(1,)``, not ``()``: FSDP2 shards no 0-dimensional parameter."""

    def __init__(self, numerics: Numerics):
        super().__init__()

        def inverse_softplus(y: float) -> float:
            return math.log(math.expm1(y))

        self.p = nn.Parameter(torch.tensor([inverse_softplus(0.8)]))
        self.n = nn.Parameter(torch.tensor([inverse_softplus(0.8 - BETA)]))
        self.numerics = numerics

    def forward(self, x):
        return xielu(x, F.softplus(self.p), BETA + F.softplus(self.n), self.numerics)


class AttentionCore(nn.Module):
    """readback's causal GQA attention op: ``(q, k, v)`` (B, heads, T, hd) -> ``(o, o_q)``, ``o``
    (B, T, heads*hd) and ``o_q`` the rounded O8 it saved, for the projection to multiply as is."""

    def __init__(self, cfg: FOGConfig, name: str, numerics: Numerics):
        super().__init__()
        self.name, self.numerics, self.scale = name, numerics, cfg.softmax_scale

    def forward(self, q, k, v):
        return attention(q, k, v, self.numerics, self.name, self.scale)


class Parts:
    """The modules FOG is built from; this class gives readback's ops (``backend=emulated``).
    A backend subclasses it and returns its own modules for the sites it runs."""

    def __init__(self, numerics: Numerics):
        self.numerics = numerics

    def linear(self, d_in: int, d_out: int, name: str, std: float) -> nn.Module:
        return Linear(d_in, d_out, name, self.numerics, std)

    def norm(self, dim: int, gain: float, name: str, eps: float, frozen: bool = False) -> nn.Module:
        return RMSNorm(dim, gain, name, self.numerics, eps, frozen)

    def attention_core(self, cfg: FOGConfig, name: str, index: int) -> nn.Module:
        return AttentionCore(cfg, name, self.numerics)

    def activation(self) -> nn.Module:
        return XIELU(self.numerics)

    def tied_head(self, x: torch.Tensor, embedding: torch.Tensor) -> torch.Tensor:
        """Logits of the LM head that shares the embedding matrix."""
        return linear(x, embedding, self.numerics, "lm_head")

    @property
    def residual_dtype(self) -> torch.dtype:
        return self.numerics.dtype

    def forward_context(self):
        """Entered around every forward (a backend's autocasts)."""
        return contextlib.nullcontext()


_ROTATIONS: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def rotation(seq: int, dim: int, base: float, device: torch.device, dtype: torch.dtype):
    """RoPE's tables ``(cos, signed_sin)`` (T, dim) in ``dtype``, laid out as the pairs they
    rotate: ``cos`` repeats each angle's cosine twice, ``signed_sin`` holds ``(-sin, +sin)``.
    Computed in FP64 once per shape and kept: a compiled graph reads them as constants instead
    of recomputing an FP64 power, cosine and sine for every element of q and k (about a seventh
    of a compiled small-FOG step)."""
    key = (seq, dim, base, device, dtype)
    if key not in _ROTATIONS:
        inv_freq = base ** (-torch.arange(0, dim, 2, device=device, dtype=torch.float64) / dim)
        angles = torch.outer(torch.arange(seq, device=device, dtype=torch.float64), inv_freq)
        cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
        _ROTATIONS[key] = torch.stack((cos, cos), -1).flatten(-2), torch.stack((-sin, sin), -1).flatten(-2)
    return _ROTATIONS[key]


def rope(x: torch.Tensor, base: float) -> torch.Tensor:
    """Rotary position embedding over the last dimension of ``x`` (B, heads, T, hd): each pair
    ``(x1, x2)`` becomes ``(x1 cos - x2 sin, x2 cos + x1 sin)``, written as ``x cos + swap(x)
    signed_sin`` so that the compiled backward is one vectorised loop, not strided slices' scalar
    loops (the same products and sums: the slice form's bits forward, its values backward)."""
    cos, signed_sin = rotation(x.shape[-2], x.shape[-1], base, x.device, x.dtype)
    swapped = x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    return x * cos + swapped * signed_sin


class Attention(nn.Module):
    def __init__(self, cfg: FOGConfig, index: int, parts: Parts):
        super().__init__()
        name, hd, std = f"layers.{index}.attn", cfg.head_dim, cfg.init_std
        self.cfg = cfg
        self.qkv = parts.linear(cfg.d_model, (cfg.n_heads + 2 * cfg.n_kv_groups) * hd, f"{name}.qkv", std)
        self.q_norm = parts.norm(hd, 1.0, f"{name}.q_norm", cfg.norm_eps, frozen=True)
        self.k_norm = parts.norm(hd, 1.0, f"{name}.k_norm", cfg.norm_eps, frozen=True)
        self.core = parts.attention_core(cfg, f"{name}.core", index)
        self.proj = parts.linear(cfg.n_heads * hd, cfg.d_model, f"{name}.proj", std)

    def forward(self, x):
        cfg, batch, seq = self.cfg, x.shape[0], x.shape[1]
        q, k, v = self.qkv(x).split([cfg.n_heads * cfg.head_dim, *[cfg.n_kv_groups * cfg.head_dim] * 2], dim=-1)
        q, k, v = (t.reshape(batch, seq, -1, cfg.head_dim) for t in (q, k, v))
        q = rope(self.q_norm(q).transpose(1, 2), cfg.rope_base)
        k = rope(self.k_norm(k).transpose(1, 2), cfg.rope_base)
        o, o_q = self.core(q, k, v.transpose(1, 2))
        # A core that hands over its rounded O8 has the projection multiply that very copy.
        return self.proj(o) if o_q is None else self.proj(o, x_q=o_q)


class MLP(nn.Module):
    def __init__(self, cfg: FOGConfig, index: int, parts: Parts):
        super().__init__()
        name = f"layers.{index}.mlp"
        self.up = parts.linear(cfg.d_model, cfg.ffn_dim, f"{name}.up", cfg.init_std)
        self.act = parts.activation()
        self.down = parts.linear(cfg.ffn_dim, cfg.d_model, f"{name}.down", cfg.init_std)

    def forward(self, x):
        return self.down(self.act(self.up(x)))


class Block(nn.Module):
    def __init__(self, cfg: FOGConfig, index: int, parts: Parts):
        super().__init__()
        name, gain = f"layers.{index}", 1 / math.sqrt(cfg.n_layers)
        self.attn = Attention(cfg, index, parts)
        self.attn_norm = parts.norm(cfg.d_model, gain, f"{name}.attn_norm", cfg.norm_eps)
        self.mlp = MLP(cfg, index, parts)
        self.mlp_norm = parts.norm(cfg.d_model, gain, f"{name}.mlp_norm", cfg.norm_eps)

    def forward(self, x):
        x = x + self.attn_norm(self.attn(x))
        return x + self.mlp_norm(self.mlp(x))


class FOG(nn.Module):
    """The FOG of ``cfg`` on the modules of ``parts`` (default: readback's ops on ``numerics``);
    ``model.numerics`` is the state of the sites readback's ops own."""

    def __init__(self, cfg: FOGConfig, numerics: Numerics, parts: Parts | None = None):
        super().__init__()
        self.parts = parts if parts is not None else Parts(numerics)
        self.cfg, self.numerics = cfg, numerics
        self.embedding = nn.Parameter(torch.empty(cfg.vocab_size, cfg.d_model))
        nn.init.normal_(self.embedding, std=cfg.init_std)
        self.layers = nn.ModuleList(Block(cfg, i, self.parts) for i in range(cfg.n_layers))
        self.lm_head = None if cfg.tied else self.parts.linear(cfg.d_model, cfg.vocab_size, "lm_head", cfg.init_std)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy (FP32) of ``idx`` against ``targets``, both (B, T)."""
        with self.parts.forward_context():
            x = F.embedding(idx, self.embedding).to(self.parts.residual_dtype) * self.cfg.embedding_multiplier
            for block in self.layers:
                x = block(x)
            logits = self.parts.tied_head(x, self.embedding) if self.lm_head is None else self.lm_head(x)
        return F.cross_entropy(
            logits.to(torch.promote_types(logits.dtype, torch.float32)).flatten(0, 1), targets.flatten()
        )

    def n_params(self) -> int:
        """Trainable parameters (frozen gains are not counted)."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad)

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6 per GEMM weight (the LM head included, tied or not), plus
        the attention score and value products (causal: half of 12 * layers * seq * width)."""
        cfg, hd = self.cfg, self.cfg.head_dim
        per_layer = cfg.d_model * (cfg.n_heads + 2 * cfg.n_kv_groups) * hd + cfg.n_heads * hd * cfg.d_model
        gemm_weights = cfg.n_layers * (per_layer + 2 * cfg.d_model * cfg.ffn_dim) + cfg.vocab_size * cfg.d_model
        return 6 * gemm_weights + 6 * cfg.n_layers * cfg.seq_len * cfg.n_heads * hd
