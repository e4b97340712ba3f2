"""Which saved tensors of a model may be stored rounded: the audit of one training step.

For each saved floating-point tensor and each storage (``e4m3``, ``e5m2``: its FP8 rounding,
current scaling, nearest; ``fresh``: a stochastic E4M3 rounding from its own stream; ``original``:
the control, exactly zero), the backward of the same forward is run with that one tensor stored
so, and the gradient error is measured against the unmodified backward per parameter group, as
the bias meter does (``|g - g_ref| / |g_ref|``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from readback.audit_model.saved import Saved, SavedTensors
from readback.bias.meter import group_of
from readback.numerics import E4M3, E5M2, compute_scale, quantize

STORAGES = ("e4m3", "e5m2", "fresh", "original")
FREE = 1e-6  # a storage whose error is below this changes no gradient: the tensor may be stored so


def stored(t: torch.Tensor, storage: str, generator: torch.Generator | None = None) -> torch.Tensor:
    """``t`` as the backward would read it from ``storage``, back in ``t``'s dtype."""
    if storage == "original":
        return t
    fmt = E5M2 if storage == "e5m2" else E4M3
    x = t.detach().float()
    scale = compute_scale(x.abs().amax(), fmt)
    rounding = "stochastic" if storage == "fresh" else "nearest"
    return quantize(x, fmt, scale, rounding, generator).dequantize(torch.float32).to(t.dtype)


@dataclass
class AuditRow:
    name: str
    shape: tuple
    dtype: str
    nbytes: int
    fp8_bytes_saved: int
    errors: dict[str, dict[str, float]]  # storage -> group (and "total") -> relative error
    verdicts: dict[str, str] = field(default_factory=dict)

    def hurts(self, top: int = 3) -> list[str]:
        """The parameter groups whose gradient some rounded storage moves most (above ``FREE``)."""
        worst: dict[str, float] = {}
        for storage, errors in self.errors.items():
            for g, e in errors.items():
                if storage != "original" and g != "total":
                    worst[g] = max(worst.get(g, 0.0), e)
        return [g for e, g in sorted(((e, g) for g, e in worst.items() if e > FREE), reverse=True)[:top]]

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "bytes": self.nbytes,
            "fp8_bytes_saved": self.fp8_bytes_saved,
            "errors": self.errors,
            "verdicts": self.verdicts,
            "hurts": self.hurts(),
        }


def verdict(error: float) -> str:
    return "free" if error <= FREE else f"{error:.1e}"


def audit_saved(
    model: torch.nn.Module, loss_fn, storages=STORAGES, seed: int = 0, min_numel: int = 2
) -> list[AuditRow]:
    """Audit ``loss_fn()`` (a scalar computed by ``model``): one row per saved floating tensor of at
    least ``min_numel`` elements, in the order the forward saved them."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    recorder = SavedTensors()
    with recorder.recording(model):
        loss = loss_fn()
    recorder.name_ops(loss)
    names = list(params)
    grads = torch.autograd.grad(loss, list(params.values()), retain_graph=True, allow_unused=True)
    reference = {n: g for n, g in zip(names, grads) if g is not None}
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for s in recorder.saved:
        if not s.tensor.is_floating_point() or s.tensor.numel() < min_numel:
            continue
        errors = {}
        for storage in storages:
            with recorder.replaced(s.index, stored(s.tensor, storage, generator)):
                grads = torch.autograd.grad(loss, [params[n] for n in reference], retain_graph=True, allow_unused=True)
            errors[storage] = _errors(reference, dict(zip(reference, grads)))
        rows.append(_row(s, errors))
    return rows


def _row(s: Saved, errors: dict) -> AuditRow:
    return AuditRow(
        s.name,
        tuple(s.tensor.shape),
        str(s.tensor.dtype).replace("torch.", ""),
        s.nbytes,
        s.nbytes - s.tensor.numel(),
        errors,
        {k: verdict(v["total"]) for k, v in errors.items()},
    )


def _errors(reference: dict, grads: dict) -> dict[str, float]:
    """Relative gradient error per parameter group and in total (a gradient that became
    unused counts as zero)."""
    diff = {
        n: (grads[n] if grads[n] is not None else torch.zeros_like(r)).double() - r.double()
        for n, r in reference.items()
    }
    out = {"total": _ratio([diff[n] for n in diff], [reference[n] for n in diff])}
    for group in dict.fromkeys(group_of(n) for n in reference):
        members = [n for n in reference if group_of(n) == group]
        out[group] = _ratio([diff[n] for n in members], [reference[n] for n in members])
    return out


def _ratio(errors: list, references: list) -> float:
    num = math.sqrt(sum(e.pow(2).sum().item() for e in errors))
    den = math.sqrt(sum(r.double().pow(2).sum().item() for r in references))
    return num / den if den > 0 else (0.0 if num == 0 else math.inf)
