"""The modules ``readback.convert`` swaps in: FOG's linear on an existing weight (an
``nn.Linear``'s, or transformers' ``Conv1D``'s read transposed), readback's norms on existing
parameters, and the router that runs a module's SDPA calls as readback's
attention op. Producer and consumer share rounded copies through a ``Handoff``."""

from __future__ import annotations

import weakref
from typing import cast

import torch
import torch.nn as nn

from readback.model.fog import Linear, Parts
from readback.numerics import BlockScalingRecipe
from readback.numerics.state import Numerics
from readback.ops.attention import attention
from readback.ops.linear import linear
from readback.ops.norm import layer_norm, rms_norm

_SDPA = torch.nn.functional.scaled_dot_product_attention


class Handoff:
    """Rounded copies of a producer's output (an attention core's O8, a norm's output) for the
    linears that consume it: a linear whose input is that output, in the same memory (a view of
    it), multiplies the copy as is, so its weight gradient reads the very bits the producer
    saved. A norm's copy is made at its site ``{norm}.output`` when the first linear asks for it:
    other consumers (a residual add, a layer left in high precision) read the norm's unrounded
    output; under a block recipe there is none (each linear quantises it by blocks, as TE's
    LayerNormLinear does). Emptied when the converted model's forward starts and ends."""

    def __init__(self, numerics: Numerics):
        self.numerics = numerics
        self._copies: dict[tuple, list] = {}

    @staticmethod
    def _key(t: torch.Tensor) -> tuple:
        return t.data_ptr(), tuple(t.shape), t.stride(), t.dtype

    def put(self, y: torch.Tensor, site: str, y_q=None) -> torch.Tensor:
        """Offer ``y``'s copy ``y_q`` rounded at ``site``, or (no ``y_q``) the copy to round
        there on demand."""
        if not self.numerics.replaying:
            self._copies[self._key(y)] = [weakref.ref(y), y._version, y_q, site]
        return y

    def take(self, x: torch.Tensor, consumer: str):
        """The rounded copy of ``x`` for the linear ``consumer`` if a producer offered one, ``x``
        was not changed since and both round alike (neither or both in ``bf16_sites``); None
        otherwise (the linear rounds ``x`` itself)."""
        entry = self._copies.get(self._key(x))
        if entry is None or entry[0]() is None or x._version != entry[1] or self.numerics.replaying:
            return None
        producer, site = entry[0](), entry[3]
        if self.numerics.spec.is_bf16_site(consumer) != self.numerics.spec.is_bf16_site(site):
            return None
        if entry[2] is None and isinstance(self.numerics.recipe, BlockScalingRecipe):
            return None  # under block scaling a linear quantises a norm's output by blocks itself, as TE's does
        if entry[2] is None:
            entry[2] = self.numerics.site(site).quantize(producer.detach(), self.numerics.rounding)
            self.numerics.account("rms_norm", output_fp8=entry[2])
        return entry[2]

    def clear(self, *_args, **_kwargs) -> None:
        self._copies.clear()


class ConvertedLinear(Linear):
    """FOG's linear (readback's FP8 GEMM) on an existing weight, and bias, added in high precision."""

    def __init__(self, module: nn.Linear, name: str, numerics: Numerics, handoff: Handoff):
        with torch.device("meta"):  # the new weight is replaced at once: allocate nothing
            super().__init__(module.in_features, module.out_features, name, numerics, std=1.0)
        self.weight, self.bias, self.handoff = cast(nn.Parameter, module.weight), module.bias, handoff

    def forward(self, x, x_q=None):
        if x_q is None:
            x_q = self.handoff.take(x, self.name)
        y = super().forward(x, x_q).to(x.dtype)
        return y if self.bias is None else y + self.bias


class ConvertedConv1D(nn.Module):
    """transformers' ``Conv1D`` (GPT-2's linears: ``y = x @ W + b`` with ``W`` of shape
    ``(in, out)``) as readback's FP8 linear op on the view ``W.mT``: the same Parameters, so the
    same shapes and ``state_dict`` keys (``weight``, ``bias``); the weight's gradient comes back
    through the view in ``W``'s own layout."""

    def __init__(self, module: nn.Module, name: str, numerics: Numerics, handoff: Handoff):
        super().__init__()
        self.weight = cast(nn.Parameter, module.weight)
        self.bias = cast(nn.Parameter | None, getattr(module, "bias", None))
        self.nf = self.weight.shape[1]  # Conv1D's name for the output width
        self.name, self.numerics, self.handoff = name, numerics, handoff

    def forward(self, x, x_q=None):
        if x_q is None:
            x_q = self.handoff.take(x, self.name)
        y = linear(x, self.weight.mT, self.numerics, self.name, x_q).to(x.dtype)
        return y if self.bias is None else y + self.bias


class ConvertedNorm(nn.Module):
    """readback's RMSNorm or LayerNorm (``center``) on the Parameters of ``module``; its output's
    rounded copy is handed to the linears that consume it."""

    def __init__(self, module: nn.Module, name: str, numerics: Numerics, center: bool, handoff: Handoff):
        super().__init__()
        weight = getattr(module, "weight", None)
        if weight is None:  # no elementwise affine: a constant unit gain
            shape = cast(tuple[int, ...], module.normalized_shape)
            self.register_buffer("weight", torch.ones(shape[-1]), persistent=False)
        else:
            self.weight = weight
        self.bias = getattr(module, "bias", None) if center else None
        self.numerics, self.name, self.eps, self.center, self.handoff = numerics, name, eps_of(module), center, handoff

    def forward(self, x):
        if self.center:
            y = layer_norm(x, self.weight, self.bias, self.numerics, self.name, self.eps)
        else:
            y = rms_norm(x, self.weight, self.numerics, self.name, self.eps)
        return self.handoff.put(y.to(x.dtype), f"{self.name}.output")


class ConvertParts(Parts):
    """FOG's parts (readback's ops), made around the Parameters of the modules they replace."""

    def __init__(self, numerics: Numerics):
        super().__init__(numerics)
        self.handoff = Handoff(numerics)

    def linear_from(self, module: nn.Linear, name: str) -> nn.Module:
        return ConvertedLinear(module, name, self.numerics, self.handoff)

    def norm_from(self, module: nn.Module, name: str, center: bool) -> nn.Module:
        return ConvertedNorm(module, name, self.numerics, center, self.handoff)

    def conv1d_from(self, module: nn.Module, name: str) -> nn.Module:
        return ConvertedConv1D(module, name, self.numerics, self.handoff)

    def describe(self, kind: str) -> str:
        return {
            "linear": "readback.ops.linear",
            "conv1d": "readback.ops.linear (on the transposed view of its (in, out) weight)",
            "layer_norm": "readback.ops.norm.layer_norm",
            "rms_norm": "readback.ops.norm.rms_norm",
        }[kind]


def eps_of(module: nn.Module) -> float:
    """A norm module's epsilon, by the names torch and transformers give it."""
    for attr in ("eps", "variance_epsilon", "epsilon"):
        value = getattr(module, attr, None)
        if isinstance(value, (int, float)):
            return float(value)
    return torch.finfo(torch.float32).eps  # torch.nn.RMSNorm(eps=None)


class SDPARouter:
    """While a marked module runs, ``F.scaled_dot_product_attention`` is readback's attention op
    (site ``{module}.core``) where that op can express the call, torch's SDPA elsewhere."""

    def __init__(self, numerics: Numerics, handoff: Handoff, report):
        self.numerics, self.handoff, self.report = numerics, handoff, report
        self.names: list[str] = []

    def attach(self, module: nn.Module, name: str) -> None:
        module.register_forward_pre_hook(lambda *_: self._enter(name))
        module.register_forward_hook(lambda *_: self._exit(), always_call=True)

    def _enter(self, name: str) -> None:
        if not self.names:
            torch.nn.functional.scaled_dot_product_attention = self
        self.names.append(name)

    def _exit(self) -> None:
        self.names.pop()
        if not self.names:
            torch.nn.functional.scaled_dot_product_attention = _SDPA

    def __call__(
        self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, **kwargs
    ):
        name = self.names[-1]
        why = self._unsupported(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa, kwargs)
        if why is not None:
            self.report.attention_left[name] = why
            return _SDPA(
                query,
                key,
                value,
                attn_mask=attn_mask,
                dropout_p=dropout_p,
                is_causal=is_causal,
                scale=scale,
                enable_gqa=enable_gqa,
                **kwargs,
            )
        batch, heads, seq, dim = query.shape
        scale = dim**-0.5 if scale is None else scale
        o, o_q = attention(query, key, value, self.numerics, f"{name}.core", scale)
        o = o.to(query.dtype)
        self.report.attention[name] = self.report.attention.get(name, 0) + 1
        # (B, T, H*hd) -> (B, H, T, hd): the caller's transpose and reshape give back o's memory.
        return self.handoff.put(o, f"{name}.core.output", o_q).view(batch, seq, heads, dim).transpose(1, 2)

    @staticmethod
    def _unsupported(q, k, v, attn_mask, dropout_p, is_causal, enable_gqa, kwargs) -> str | None:
        if kwargs:
            return f"arguments {sorted(kwargs)}"
        if attn_mask is not None:
            return "an attn_mask (readback's op is causal, mask-free)"
        if not is_causal:
            return "is_causal=False"
        if dropout_p:
            return f"dropout_p={dropout_p}"
        if q.dim() != 4 or q.shape[-2] != k.shape[-2] or k.shape != v.shape or q.shape[-1] != k.shape[-1]:
            return f"shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        if k.shape[1] != q.shape[1] and not (enable_gqa and q.shape[1] % k.shape[1] == 0):
            return f"{q.shape[1]} query heads over {k.shape[1]} key heads without enable_gqa"
        return None
