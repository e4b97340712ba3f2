"""The bias meter's estimators, over N batches of one parameter group.

``e`` holds the per-batch errors ``e_b = g_variant,b - g_exact,b`` and ``r`` the per-batch exact
gradients ``g_exact,b``, both ``(N, elements)`` in FP64; ``G = mean_b r_b`` and ``ē = mean_b e_b``.
``S = tr(Cov e) = sum_b |e_b - ē|^2 / (N - 1)`` is the sample covariance's trace. Every standard
error treats ``G`` as fixed (its own spread over batches is not propagated), except the cosine's
jackknife, which recomputes ``G`` too. Cost: O(N x elements), nothing quadratic in N.

* ``bias = |ē| / |G|``. Since ``E|ē|^2 = |E e|^2 + tr(Cov e) / N``, it reads about ``floor`` even
  when ``E e = 0``: large means large, small does not mean small.
* ``bias_se = sqrt(S / N) / |G|`` (the spread of ``e_b``), and ``floor``, the same number under
  the name of what it is: the root mean square of ``bias`` when the true bias is zero.
* ``cosine`` of ``ē`` with ``G``; ``cosine_se`` the delete-one jackknife over batches.
* ``rel_err``: the mean over batches of ``|e_b| / |r_b|`` (bias and noise together), and
  ``rel_err_max`` its largest, the tail over batches.
* ``projection = -ē.G / |G|^2``, the share of the gradient the bias removes (negative: it adds);
  the mean of the per-batch ``p_b = -e_b.G / |G|^2``, so unbiased for ``-E e.G / |G|^2``, and
  ``projection_se = sd(p_b) / sqrt(N)`` (sd with N - 1).
* ``debiased_sq = (|ē|^2 - S / N) / |G|^2``, unbiased for ``|E e|^2 / |G|^2`` (comparable with
  ``bias^2``; it can be negative when the bias is below the floor). It is the U-statistic
  ``sum_{a != b} e_a.e_b / (N (N - 1))``, whose variance is ``4 s1 / N + 2 s2 / (N (N - 1))``
  with ``s1 = (E e)' Cov(e) (E e)`` and ``s2 = tr(Cov(e)^2)`` (Hoeffding). ``debiased_sq_se`` is
  the square root of that with ``s2`` estimated without bias from independent pair differences
  (:func:`_trace_of_squared_covariance`) and ``4 s1 / N`` as the delete-one jackknife variance
  less its expected degenerate part ``4 s2 / (N (N - 2))``, but at least half its plug-in along
  the mean error's own direction, ``4 U+ (ê' Ŝ ê) / N`` with ``U+ = max(|ē|^2 - S / N, 0)`` and
  ``ê = ē / |ē|``. The jackknife alone would overstate the variance 2 (N - 1) / (N - 2) times at
  zero bias; less its degenerate part it is unbiased where the bias is well above the floor and
  conservative near zero bias (at none, about 1.3 times the true SE at 8 batches, 1.2 times at
  32), but at N <= 16 it can fall to 0 where the bias is clearly not zero (on real errors, SEs
  half the null's: ``docs/results/meter_calibration/preregistration_nonzero.md``); the guard,
  silent at zero bias, stops that collapse and only ever widens. N >= 4.

On nulls (``docs/results/meter_calibration``) the projection's z = projection / projection_se
follows Student's t with N - 1 degrees of freedom (read it against t's quantiles, 2.36 at 8
batches, not 2), and the debiased z is conservative (sd about 0.75).

A statistic needing more batches than there are is NaN: the SEs, ``floor`` and ``debiased_sq``
need N >= 2, ``debiased_sq_se`` N >= 4.
"""

from __future__ import annotations

import math

import torch

STATS = (
    "bias",
    "bias_se",
    "cosine",
    "cosine_se",
    "rel_err",
    "rel_err_max",
    "projection",
    "projection_se",
    "debiased_sq",
    "debiased_sq_se",
    "floor",
)
TINY = 1e-300  # keeps a zero gradient's ratios finite (0 / TINY = 0)


def group_stats(e: torch.Tensor, r: torch.Tensor, guard: bool = True) -> dict[str, float]:
    """Every statistic of the module docstring, of errors ``e`` against exact gradients ``r``;
    ``guard`` False leaves out the plug-in's floor under ``debiased_sq_se``'s linear part (the
    rule before it, which the meter's calibration measures beside it)."""
    n = e.shape[0]
    mean_error, mean_grad = e.mean(0), r.mean(0)
    scale = mean_grad.norm().clamp_min(TINY)
    per_batch_projection = -(e @ mean_grad) / scale**2
    relative = e.norm(dim=1) / r.norm(dim=1).clamp_min(TINY)  # |e_b| / |g_b|
    stats = {
        "bias": (mean_error.norm() / scale).item(),
        "cosine": _cosine(mean_error[None], mean_grad[None]).item(),
        "rel_err": relative.mean().item(),
        "rel_err_max": relative.max().item(),
        "projection": per_batch_projection.mean().item(),
        **dict.fromkeys(("bias_se", "cosine_se", "projection_se", "debiased_sq", "debiased_sq_se", "floor"), math.nan),
    }
    if n < 2:
        return stats
    deviations = e - mean_error
    spread = deviations.pow(2).sum().item() / (n - 1)  # S = tr(Cov e)
    floor = math.sqrt(spread / n) / scale.item()
    stats.update(
        bias_se=floor,
        floor=floor,
        projection_se=per_batch_projection.std().item() / math.sqrt(n),
        debiased_sq=(mean_error.pow(2).sum().item() - spread / n) / scale.item() ** 2,
        cosine_se=_jackknife_se(_leave_one_out_cosines(e, r)),
    )
    if n >= 4:
        s2 = _trace_of_squared_covariance(e)
        jackknife = _jackknife_se(_leave_one_out_debiased(mean_error, deviations)) ** 2 - 4 * s2 / (n * (n - 2))
        plug_in = _plug_in_linear(mean_error, deviations, spread) if guard else 0.0
        linear = max(jackknife, 0.5 * plug_in, 0.0)
        variance = linear + 2 * s2 / (n * (n - 1))
        stats["debiased_sq_se"] = math.sqrt(variance) / scale.item() ** 2
    return stats


def _cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Row-wise cosine of ``a`` and ``b`` (0 where either is 0)."""
    return torch.nn.functional.cosine_similarity(a, b, dim=1, eps=TINY)


def _leave_one_out_cosines(e: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """The cosine of the mean error with the mean gradient, each batch left out in turn: the
    sums less one row (the 1 / (N - 1) of both means cancels in a cosine)."""
    return _cosine(e.sum(0) - e, r.sum(0) - r)


def _leave_one_out_debiased(mean_error: torch.Tensor, deviations: torch.Tensor) -> torch.Tensor:
    """``|ē_(i)|^2 - S_(i) / (N - 1)`` with batch ``i`` left out, from ``d_i = e_i - ē``:
    ``ē_(i) = ē - d_i / (N - 1)`` and ``(N - 2) S_(i) = sum_b |d_b|^2 - |d_i|^2 N / (N - 1)``."""
    n = deviations.shape[0]
    along = deviations @ mean_error  # ē . d_i
    squares = deviations.pow(2).sum(1)  # |d_i|^2
    mean_sq = mean_error.pow(2).sum() - 2 * along / (n - 1) + squares / (n - 1) ** 2
    spread = (squares.sum() - squares * n / (n - 1)) / (n - 2)
    return mean_sq - spread / (n - 1)


def _plug_in_linear(mean_error: torch.Tensor, deviations: torch.Tensor, spread: float) -> float:
    """``4 s1 / N`` estimated as ``4 U+ (ê' Ŝ ê) / N``: the unbiased ``|E e|^2`` (clamped at 0)
    times the batches' spread along the mean error's direction ``ê``, ``s1 = (E e)' Cov(e) (E e)``
    where the bias stands above the floor."""
    n = deviations.shape[0]
    squared_mean = mean_error.pow(2).sum().item() - spread / n
    norm = mean_error.norm()
    if squared_mean <= 0 or norm == 0:
        return 0.0
    along = (deviations @ (mean_error / norm)).pow(2).sum().item() / (n - 1)
    return 4 * squared_mean * along / n


def _trace_of_squared_covariance(e: torch.Tensor) -> float:
    """An unbiased estimate of ``tr(Cov(e)^2)`` in O(N): the pair differences
    ``u_j = (e_2j - e_2j+1) / sqrt(2)`` are independent with mean 0 and covariance ``Cov(e)``, so
    ``E (u_j.u_k)^2 = tr(Cov(e)^2)`` for j != k; the mean over neighbours ``k = j + 1`` (cyclic)."""
    pairs = e.shape[0] // 2
    u = (e[0 : 2 * pairs : 2] - e[1 : 2 * pairs : 2]) / math.sqrt(2)
    return (u * u.roll(-1, 0)).sum(1).pow(2).mean().item()


def _jackknife_se(leave_one_out: torch.Tensor) -> float:
    """Delete-one jackknife: ``sqrt((N - 1) / N * sum_i (t_(i) - mean t_(.))^2)``."""
    n = leave_one_out.shape[0]
    return math.sqrt((n - 1) / n * (leave_one_out - leave_one_out.mean()).pow(2).sum().item())
