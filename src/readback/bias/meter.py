"""The bias meter: what each read costs the gradient, averaged over batches.

For each batch, one forward with the run's rounding (its tape kept) and the reference gradient
of that executed forward (:func:`readback.probe.reference_gradients`); then, for each
:class:`~readback.bias.variants.Variant`, the same forward again (same scales, same random
streams: bit-identical, which is checked) and its backward as the variant says. Over N batches,
per parameter group and in total, with ``e_b = g_variant - g_exact`` and ``G`` the mean exact
gradient:

* ``bias = |mean_b e_b| / |G|`` with its standard error (the spread of ``e_b`` over batches);
* ``cosine`` of ``mean_b e_b`` with ``G`` (negative: the error shrinks the gradient), with a
  jackknife standard error;
* ``rel_err``: the mean over batches of ``|e_b| / |g_b|`` (bias and noise together).

Beside each variant's error, the meter reports each read's own contribution, paired within the
batch so that the backward's other roundings cancel: ``contrib.<policy>`` is
``g_policy - g_exact`` (both with the configured gradient roundings: the policy's D-term read
alone), and ``contrib.<read>`` is ``g_configured - g_<read switched to exact>`` (e.g.
``contrib.exact_read.attention.D`` under reuse_rounded, ``contrib.exact_bwd.attention`` for the
attention backward's E5M2 roundings).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from readback.bias.variants import Variant, applied, variants
from readback.probe import reference_gradients, taped_backward

STATS = ("bias", "bias_se", "cosine", "cosine_se", "rel_err")


def group_of(name: str) -> str:
    """A parameter's group: the module that owns it (``layers.1.attn.qkv.weight`` -> ``layers.1.attn.qkv``)."""
    return name.rsplit(".", 1)[0] if "." in name else name


@dataclass
class BiasResult:
    """``stats[variant][group][stat]``; ``variants`` in order; cost of one batch in seconds and
    in plain training steps (one forward and backward of the same batch)."""

    variants: list[Variant]
    groups: list[str]
    stats: dict[str, dict[str, dict[str, float]]]
    batches: int
    seconds_per_batch: float
    steps_per_batch: float
    policy: str = ""
    info: dict = field(default_factory=dict)

    def metrics(self) -> dict[str, float]:
        """Training keys: ``grad_bias/<variant>/<group>``, ``grad_bias_se/...``, ``grad_bias_cos/...``."""
        out = {}
        for v, groups in self.stats.items():
            for g, s in groups.items():
                out[f"grad_bias/{v}/{g}"] = s["bias"]
                out[f"grad_bias_cos/{v}/{g}"] = s["cosine"]
                if self.batches > 1:
                    out[f"grad_bias_se/{v}/{g}"] = s["bias_se"]
        return out

    def to_json(self) -> dict:
        return {
            "policy": self.policy,
            "batches": self.batches,
            "seconds_per_batch": self.seconds_per_batch,
            "steps_per_batch": self.steps_per_batch,
            "groups": self.groups,
            **self.info,
            "variants": [{"name": v.name, "what": v.what} for v in self.variants],
            "stats": self.stats,
        }


def measure_bias(model, batches, which: list[Variant] | None = None, dtype=torch.float64) -> BiasResult:
    """The meter over ``batches`` (``(inputs, targets)`` pairs). Leaves the model's gradients and
    its numerics (scales, histories, random streams, counts) as they were."""
    numerics = model.numerics
    which = variants(numerics) if which is None else which
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    saved_grads = {n: p.grad for n, p in params.items()}
    errors: dict[str, list[dict[str, torch.Tensor]]] = {v.name: [] for v in which}
    references = []
    start, step_seconds = time.perf_counter(), []
    try:
        for b, (x, y) in enumerate(batches):
            salt = f"/bias{b}"
            with numerics.isolated(salt):
                t0 = time.perf_counter()
                loss, tape = _backward(model, params, x, y)
                step_seconds.append(time.perf_counter() - t0)
                reference = reference_gradients(model, params, tape, x, y, dtype)
            references.append(reference)
            for v in which:
                with numerics.isolated(salt), applied(numerics, v):
                    v_loss, _ = _backward(model, params, x, y)
                    if not torch.equal(v_loss, loss):
                        raise RuntimeError(f"variant {v.name}: forward differs from the executed one")
                    errors[v.name].append(
                        {n: p.grad.double() - reference[n] for n, p in params.items() if n in reference}
                    )
    finally:
        for n, p in params.items():
            p.grad = saved_grads[n]
    n_batches = len(references)
    seconds = (time.perf_counter() - start) / max(n_batches, 1)
    groups = list(dict.fromkeys(group_of(n) for n in references[0]))
    stats = {v.name: _statistics(errors[v.name], references, groups) for v in which}
    for name, pairs in _contributions(which, errors, numerics.policy).items():
        stats[name] = _statistics(pairs, references, groups)
    return BiasResult(
        which,
        ["total", *groups],
        stats,
        n_batches,
        seconds,
        seconds / max(sum(step_seconds) / max(n_batches, 1), 1e-12),
        numerics.policy,
    )


def _backward(model, params, x, y):
    for p in params.values():
        p.grad = None
    return taped_backward(model, x, y)


def _contributions(which: list[Variant], errors: dict, configured: str) -> dict[str, list[dict]]:
    """``contrib.<variant>`` -> per-batch gradient differences (see the module docstring)."""

    def diff(a: str, b: str) -> list[dict]:
        return [{n: x[n] - y[n] for n in x} for x, y in zip(errors[a], errors[b])]

    out = {}
    for v in which:
        if v.policy and not v.exact_bwd and v.name != "exact" and "exact" in errors:
            out[f"contrib.{v.name}"] = diff(v.name, "exact")
        elif v.policy is None and v.name != configured and configured in errors:
            out[f"contrib.{v.name}"] = diff(configured, v.name)
    return out


def _statistics(errors: list[dict], references: list[dict], groups: list[str]) -> dict[str, dict[str, float]]:
    out = {}
    for group in ["total", *groups]:
        names = [n for n in references[0] if group == "total" or group_of(n) == group]
        e = torch.stack([torch.cat([d[n].flatten() for n in names]) for d in errors])
        r = torch.stack([torch.cat([d[n].flatten() for n in names]) for d in references])
        out[group] = _group_stats(e, r)
    return out


def _group_stats(e: torch.Tensor, r: torch.Tensor) -> dict[str, float]:
    """Statistics of errors ``e`` against exact gradients ``r``, both (batches, elements)."""
    k = e.shape[0]
    scale = r.mean(0).norm().clamp_min(1e-300)
    mean_error = e.mean(0)

    def cosine(m: torch.Tensor, g: torch.Tensor) -> float:
        return torch.nn.functional.cosine_similarity(m, g, dim=0, eps=1e-300).item()

    stats = {
        "bias": (mean_error.norm() / scale).item(),
        "cosine": cosine(mean_error, r.mean(0)),
        "rel_err": (e.norm(dim=1) / r.norm(dim=1).clamp_min(1e-300)).mean().item(),
        "bias_se": math.nan,
        "cosine_se": math.nan,
    }
    if k > 1:
        spread = (e - mean_error).pow(2).sum().item() / (k - 1)
        stats["bias_se"] = math.sqrt(spread / k) / scale.item()
        keep = ~torch.eye(k, dtype=torch.bool)
        leave_one_out = [cosine(e[keep[i]].mean(0), r[keep[i]].mean(0)) for i in range(k)]
        mean = sum(leave_one_out) / k
        stats["cosine_se"] = math.sqrt((k - 1) / k * sum((c - mean) ** 2 for c in leave_one_out))
    return stats
