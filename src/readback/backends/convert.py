"""``readback.convert``: any ``torch.nn.Module`` in readback's FP8, recipe and policy from config.

As Accelerate's FP8 support and torchao's ``convert_to_float8_training`` do, the converter walks
the model and swaps modules in place, keeping their Parameters: ``nn.Linear`` for readback's FP8
linear (FOG's ``Linear``, made by a subclass of FOG's ``Parts``, so a converted model and FOG
multiply through one module), transformers' ``Conv1D`` (GPT-2) for the same op on its weight's
transposed view (left under ``backend="te"``: ``TE_CONV1D``), ``nn.LayerNorm`` and RMSNorm
modules (``torch.nn.RMSNorm``, and classes named ``*RMSNorm`` whose output is
``weight * x / rms(x)``) for readback's norm ops (``readback.backends.converted``). A norm's
rounded output is handed to the converted linears that consume it (``x_q``), as readback's norm
does; so is the attention core's O8 to the output projection: inside a module that calls
``torch.nn.functional.scaled_dot_product_attention`` (HF's ``*Attention`` with
``attn_implementation="sdpa"``), causal, mask-free calls run readback's attention op, so the
D-term policies apply. ``backend="te"`` swaps in Transformer Engine's modules instead (CUDA).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import inspect
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn as nn
from omegaconf import OmegaConf
from omegaconf.errors import ValidationError

from readback.backends.converted import ConvertParts, SDPARouter, eps_of
from readback.errors import ConfigError, choose, require, some_of
from readback.numerics.attention_settings import AttentionSettings
from readback.numerics.precision_settings import PRECISIONS, Fp8Settings, PrecisionSettings, ReferencePrecision
from readback.numerics.settings import NumericsSettings
from readback.numerics.state import Numerics
from readback.ops import numerics_spec
from readback.overrides import RENAMED_KEYS

FP8_ALIGNMENT = 16
# transformers' Conv1D keeps its weight as (in, out); te.Linear holds (out, in) and would need a
# transposed copy of it: a new Parameter and another state_dict layout.
TE_CONV1D = "Conv1D's weight is (in, out): te.Linear would need a transposed copy of it (not the same Parameter)"


@dataclass
class ConvertReport:
    """What ``convert`` did: ``swapped`` ``{module name: what it became}``, ``left`` ``{module
    name: why not}``; ``attention`` ``{module name: calls routed to readback's attention op}`` and
    ``attention_left`` ``{module name: why a call ran torch's SDPA}`` fill in as the model runs."""

    numerics: Numerics
    swapped: dict[str, str] = field(default_factory=dict)
    left: dict[str, str] = field(default_factory=dict)
    attention: dict[str, int] = field(default_factory=dict)
    attention_left: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        lines = [f"swapped {len(self.swapped)}, left {len(self.left)}"]
        lines += [f"  {name}: {what}" for name, what in self.swapped.items()]
        lines += [f"  {name}: left ({why})" for name, why in self.left.items()]
        lines += [f"  {name}: SDPA not routed ({why})" for name, why in self.attention_left.items()]
        return "\n".join(lines)


def _is_rms_norm(module: nn.Module) -> str | None:
    """Why ``module`` is not an RMSNorm readback can take over (None when it is): torch's, or a
    class named ``*RMSNorm`` with a 1-D ``weight`` whose output is ``weight * x / rms(x)``."""
    if isinstance(module, nn.RMSNorm):
        return None if len(module.normalized_shape) == 1 else "normalises over more than the last dimension"
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1:
        return "no 1-D weight"
    if weight.is_meta:
        return None
    x = torch.randn(3, weight.shape[0], generator=torch.Generator().manual_seed(0)).to(weight)  # global RNG untouched
    with torch.no_grad():
        rms = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps_of(module))
        expected = weight * (x.float() * rms).to(x.dtype)
        if not torch.allclose(module(x), expected, rtol=1e-3, atol=1e-5):
            return "output is not weight * x / rms(x)"
    return None


@functools.cache
def _calls_sdpa(cls: type[nn.Module]) -> bool:
    """Whether the forward of ``cls`` calls torch's SDPA, directly or through HF's attention
    functions (``ALL_ATTENTION_FUNCTIONS``)."""
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False
    return "scaled_dot_product_attention" in source or "ALL_ATTENTION_FUNCTIONS" in source


def _numerics(
    precision, policy: str, attention_bwd_precision: str, seed: int, attention_recipe: str | None = None
) -> Numerics:
    """The ``Numerics`` of ``precision``: ``"fp8"``, ``"bf16"``, ``"off"``, or a mapping of recipe
    keys (Transformer Engine's names), checked by the numerics settings' own schema and rules."""
    from readback.fields import valid_text

    attention = AttentionSettings(bwd_precision=attention_bwd_precision, bwd_reads="forward", recipe=attention_recipe)
    if isinstance(precision, str):
        precision = {"name": precision}
    precision = dict(
        cast(Mapping[str, Any], OmegaConf.to_container(precision)) if OmegaConf.is_config(precision) else precision
    )
    name = choose("precision.name", precision.pop("name", "fp8"), PRECISIONS)
    schema = {"fp8": Fp8Settings, "bf16": PrecisionSettings, "off": ReferencePrecision}[name]
    keys = [f.name for f in dataclasses.fields(schema) if f.name != "name"]
    for key in precision:
        if f"precision.{key}" in RENAMED_KEYS:  # the attention core's recipe: an argument of its own now
            raise ConfigError(f"precision.{key}", precision[key], f"not a precision key; say {key}={precision[key]!r}")
        choose("precision", key, keys)
    values = {"name": name, **precision}  # the schema holds the defaults
    try:
        node = OmegaConf.merge(OmegaConf.structured(schema), values)  # types
    except ValidationError as error:
        raise ConfigError(
            f"precision.{error.key}", values.get(error.key), valid_text(schema, str(error.key)) or "a value of its type"
        ) from None
    groups = OmegaConf.to_object(node)  # ranges and choices
    assert isinstance(groups, PrecisionSettings)
    settings = NumericsSettings(groups, attention, policy)
    settings.check()
    return Numerics(numerics_spec(settings), seed=seed)


def _matches(name: str, patterns: Iterable[str]) -> str | None:
    """The first pattern naming ``name`` or a module above it (fnmatch, or a dotted prefix)."""
    parts = name.split(".")
    for pattern in patterns:
        if any(fnmatch.fnmatchcase(".".join(parts[:i]), pattern) for i in range(1, len(parts) + 1)):
            return pattern
    return None


def _kind(module: nn.Module) -> str | None:
    if isinstance(module, nn.Linear):
        return "linear"
    conv1d = getattr(sys.modules.get("transformers.pytorch_utils"), "Conv1D", None)  # imported if used
    if conv1d is not None and isinstance(module, conv1d):
        return "conv1d"
    if isinstance(module, nn.LayerNorm):
        return "layer_norm"
    if isinstance(module, nn.RMSNorm) or type(module).__name__.endswith("RMSNorm"):
        return "rms_norm"
    return None


def _why_left(module: Any, kind: str | None) -> str | None:
    if kind is None:
        return f"unknown type {type(module).__name__}"
    if kind in ("linear", "conv1d"):
        shape = (module.out_features, module.in_features) if kind == "linear" else tuple(module.weight.shape[::-1])
        if any(n % FP8_ALIGNMENT for n in shape):
            return f"shape {shape} not a multiple of {FP8_ALIGNMENT}"
        return None
    if kind == "layer_norm" and len(module.normalized_shape) != 1:
        return "normalises over more than the last dimension"
    if kind == "rms_norm" and (why := _is_rms_norm(module)) is not None:
        return why
    return None


def _check_filter(model: nn.Module, filter: tuple[str, ...]) -> None:
    """``ConfigError`` for a ``filter`` pattern that names no module of ``model`` (by ``_matches``'s
    rule), listing the modules that hold parameters, before anything is swapped."""
    names = [name for name, _ in model.named_modules() if name]
    for pattern in filter:
        require(
            any(_matches(name, (pattern,)) for name in names),
            "filter",
            pattern,
            "module-name patterns (globs or dotted prefixes) naming a module of the model, e.g. "
            + some_of(n for n, m in model.named_modules() if n and list(m.parameters(recurse=False))),
        )


def convert(
    model: nn.Module,
    precision: str | Mapping | Numerics = "fp8",
    policy: str = "exact",
    backend: str = "emulated",
    filter: Iterable[str] = (),
    attention: bool = True,
    attention_bwd_precision: str = "fp8",
    attention_recipe: str | None = None,
    seed: int = 0,
) -> ConvertReport:
    """Swap ``model``'s linears, norms and (``attention``) SDPA cores for readback's, in place.

    ``precision``: ``"fp8"`` (Transformer Engine's DelayedScaling defaults), ``"bf16"``, ``"off"``
    (no rounding, FP64 GEMMs), a mapping of recipe keys (``recipe``, ``fp8_format``, ``margin``,
    ``interval``, ``amax_history_len``, ``amax_compute_algo``, ``override_linear_precision``,
    ``rounding``), or a ``Numerics``. ``attention_bwd_precision`` and ``attention_recipe``: the
    ``attention`` group's ``bwd_precision`` and ``recipe`` (the core's own FP8 recipe: None, the
    linears'; ``"delayed"``; ``"current"``). ``filter``: module-name patterns left in high precision
    (``lm_head``), with everything below them. Sets ``model.numerics``; returns the report.
    Raises ``ConfigError`` (one line) for a bad key or value.
    """
    choose("backend", backend, ("emulated", "te"))
    if isinstance(getattr(model, "numerics", None), Numerics):
        raise ConfigError(
            "model",
            type(model).__name__,
            "a model that has no readback numerics yet (this one was "
            "converted, or built from readback's parts, already)",
        )
    filter = tuple(filter)
    _check_filter(model, filter)
    numerics = (
        precision
        if isinstance(precision, Numerics)
        else _numerics(precision, policy, attention_bwd_precision, seed, attention_recipe)
    )
    report = ConvertReport(numerics)
    parts: ConvertParts | TEConverter
    if backend == "te":
        from readback.backends.te.convert import TEConverter

        parts = TEConverter(numerics, next(model.parameters()).device)
    else:
        parts = ConvertParts(numerics)
    swaps = []
    for name, module in [(name, m) for name, m in model.named_modules() if name]:
        if type(module).__module__.startswith("readback."):
            continue  # already readback's (FOG's parts, an earlier conversion)
        kind = _kind(module)
        if kind is None and attention and backend == "emulated" and _calls_sdpa(type(module)):  # type: ignore[arg-type]  # a class is hashable; mypy's Hashable misses type[...]
            kind = "attention"
        if kind is None and (next(module.children(), None) is not None or not list(module.parameters(recurse=False))):
            continue  # containers and parameter-free leaves are not reported
        pattern = _matches(name, filter)
        why = f"filtered ({pattern})" if pattern else (None if kind == "attention" else _why_left(module, kind))
        if why is None and kind == "conv1d" and backend == "te":
            why = TE_CONV1D
        if why is not None:
            report.left[name] = why
        elif kind == "attention":
            assert isinstance(parts, ConvertParts)  # SDPA is routed on the emulated backend only
            SDPARouter(numerics, parts.handoff, report).attach(module, name)
            report.swapped[name] = "SDPA -> readback.ops.attention (causal, mask-free calls)"
        elif kind is not None:  # else _why_left said why
            swaps.append((name, module, kind))
    for name, module, kind in swaps:
        if kind == "linear":
            new = parts.linear_from(module, name)
        elif kind == "conv1d":
            assert isinstance(parts, ConvertParts)  # left under backend="te"
            new = parts.conv1d_from(module, name)
        else:
            new = parts.norm_from(module, name, center=kind == "layer_norm")
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, new)
        report.swapped[name] = f"{type(module).__name__} -> {parts.describe(kind)}"
    if isinstance(parts, ConvertParts):  # backend="emulated"
        model.register_forward_pre_hook(parts.handoff.clear)
        model.register_forward_hook(parts.handoff.clear, always_call=True)
    model.numerics = numerics  # type: ignore[assignment]  # a plain attribute, as on FOG
    return report


if TYPE_CHECKING:
    from readback.backends.te.convert import TEConverter

__all__ = ["ConfigError", "ConvertReport", "convert"]
