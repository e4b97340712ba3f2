"""The bias meter: what each read costs the gradient, averaged over batches.

For each batch, one forward with the run's rounding (its tape kept) and the reference gradient
of that executed forward (:func:`readback.probe.reference_gradients`); then, for each
:class:`~readback.bias.variants.Variant`, the same forward again (same scales, same random
streams: bit-identical, which is checked) and its backward as the variant says. Over N batches,
per parameter group and in total, with ``e_b = g_variant - g_exact`` and ``G`` the mean exact
gradient, the statistics of :mod:`readback.bias.estimators`: the relative bias ``|mean e| / |G|``
and its floor, the cosine with ``G``, the projection ``-mean(e).G / |G|^2`` and the debiased
``|E e|^2 / |G|^2``, with standard errors. O's rounding in the same executed forwards is
:mod:`readback.bias.output_rounding`'s.

Beside each variant's error, the meter reports each read's own contribution, paired within the
batch so that the backward's other roundings cancel: ``contrib.<policy>`` is
``g_policy - g_exact`` (both with the configured gradient roundings: the policy's D-term read
alone), and ``contrib.<read>`` is ``g_configured - g_<read switched to exact>`` (e.g.
``contrib.exact_read.attention.D`` under reuse_rounded, ``contrib.exact_bwd.attention`` for the
attention backward's E5M2 roundings, ``contrib.ieee_acc.dgrad`` for the tensor core's way of
adding in the linears' dgrad GEMMs). Each linear's GEMM sizes K (the length of the sums its
fprop, dgrad and wgrad add) are read from the executed forward's tape.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from readback.bias.estimators import group_stats
from readback.bias.output_rounding import OutputRounding
from readback.bias.variants import Variant, applied, variants
from readback.numerics import BF16
from readback.probe import reference_gradients, taped_backward


def group_of(name: str) -> str:
    """A parameter's group: the module that owns it (``layers.1.attn.qkv.weight`` -> ``layers.1.attn.qkv``)."""
    return name.rsplit(".", 1)[0] if "." in name else name


@dataclass
class BiasResult:
    """``stats[variant][group][stat]``; ``variants`` in order; cost of one batch in seconds and
    in plain training steps (one forward and backward of the same batch); ``site_margin``, the
    margins the run's numerics applied (``{pattern: k}``); ``o_rounding``, O's rounding per
    attention layer (:mod:`readback.bias.output_rounding`); ``gemm_k``, each linear's
    ``{fprop, dgrad, wgrad: K}`` (:func:`gemm_sizes`)."""

    variants: list[Variant]
    groups: list[str]
    stats: dict[str, dict[str, dict[str, float]]]
    batches: int
    seconds_per_batch: float
    steps_per_batch: float
    policy: str = ""
    info: dict = field(default_factory=dict)
    site_margin: dict[str, int] = field(default_factory=dict)
    o_rounding: dict[str, dict[str, float]] = field(default_factory=dict)
    gemm_k: dict[str, dict[str, int]] = field(default_factory=dict)

    def metrics(self) -> dict[str, float]:
        """Training keys ``grad_bias_<stat>/<variant>/<group>``: ``grad_bias`` (bias),
        ``grad_bias_cos``, ``grad_bias_projection``; with 2 batches or more ``grad_bias_se``,
        ``grad_bias_projection_se`` and ``grad_bias_debiased_sq``; with 4 or more ``grad_bias_debiased_sq_se``."""
        keys = {"": "bias", "_cos": "cosine", "_projection": "projection"}
        if self.batches > 1:
            keys.update({"_se": "bias_se", "_projection_se": "projection_se", "_debiased_sq": "debiased_sq"})
        if self.batches > 3:
            keys["_debiased_sq_se"] = "debiased_sq_se"
        return {
            f"grad_bias{key}/{v}/{g}": s[stat]
            for v, groups in self.stats.items()
            for g, s in groups.items()
            for key, stat in keys.items()
        }

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
            "site_margin": self.site_margin,
            "o_rounding": self.o_rounding,
            "gemm_k": self.gemm_k,
        }


def measure_bias(model, batches, which: list[Variant] | None = None, dtype=torch.float64, contrasts=None) -> BiasResult:
    """The meter over ``batches`` (``(inputs, targets)`` pairs). ``contrasts``: ``errors`` ->
    ``{name: per-batch differences}`` in place of the ``contrib.*`` ones (e.g.
    ``backward_parts.part_contrasts``). Leaves the model's gradients and its numerics (scales,
    histories, random streams, counts) as they were."""
    numerics = model.numerics
    which = variants(numerics) if which is None else which
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    saved_grads = {n: p.grad for n, p in params.items()}
    errors: dict[str, list[dict[str, torch.Tensor]]] = {v.name: [] for v in which}
    references = []
    o_rounding = OutputRounding()
    start, step_seconds = time.perf_counter(), []
    gemm_k: dict[str, dict[str, int]] = {}
    try:
        for b, (x, y) in enumerate(batches):
            salt = f"/bias{b}"
            with numerics.isolated(salt):
                t0 = time.perf_counter()
                loss, tape = _backward(model, params, x, y)
                step_seconds.append(time.perf_counter() - t0)
                o_rounding.add(numerics, tape)
                gemm_k = gemm_k or gemm_sizes(tape)
                reference = reference_gradients(model, params, tape, x, y, dtype)
            references.append(reference)
            for name, error in variant_errors(model, params, (x, y), loss, reference, which, salt).items():
                errors[name].append(error)
    finally:
        for n, p in params.items():
            p.grad = saved_grads[n]
    n_batches = len(references)
    seconds = (time.perf_counter() - start) / max(n_batches, 1)
    groups = list(dict.fromkeys(group_of(n) for n in references[0]))
    stats = {v.name: _statistics(errors[v.name], references, groups) for v in which}
    paired = contrasts(errors) if contrasts else _contributions(which, errors, numerics.policy)
    for name, pairs in paired.items():
        stats[name] = _statistics(pairs, references, groups)
    return BiasResult(
        which,
        ["total", *groups],
        stats,
        n_batches,
        seconds,
        seconds / max(sum(step_seconds) / max(n_batches, 1), 1e-12),
        numerics.policy,
        site_margin=dict(numerics.spec.site_margin),
        o_rounding=o_rounding.summary(),
        gemm_k=gemm_k,
    )


def variant_errors(model, params, batch, loss, reference, which: list[Variant], salt: str) -> dict[str, dict]:
    """``{variant: {parameter: g_variant - reference}}`` on one batch, each variant's backward
    under the random streams of ``salt``; its forward must give the executed ``loss`` bit for bit
    (the forward draws nothing at random unless the forward rounds stochastically)."""
    out = {}
    for v in which:
        with model.numerics.isolated(salt), applied(model.numerics, v):
            v_loss, _ = _backward(model, params, *batch)
            if not torch.equal(v_loss, loss):
                raise RuntimeError(f"variant {v.name}: forward differs from the executed one")
            out[v.name] = {n: p.grad.double() - reference[n] for n, p in params.items() if n in reference}
    return out


def gemm_sizes(tape: list) -> dict[str, dict[str, int]]:
    """Each FP8 linear's K from its tape record (input rows x in, weight out x in): fprop sums
    over the input features, dgrad over the output features, wgrad over the batch's tokens.
    Linears kept in BF16 are left out: ``precision.accumulation`` is the FP8 GEMMs'."""
    return {
        site: {"fprop": w.shape[1], "dgrad": w.shape[0], "wgrad": x.shape[0]}
        for site, record in tape
        if {"input", "weight"} <= record.keys() and record["weight"].fmt not in (None, BF16)
        for x, w in [(record["input"].data, record["weight"].data)]
    }


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
        out[group] = group_stats(e, r)
    return out
