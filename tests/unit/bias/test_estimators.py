"""The bias meter's estimators: each equals its definition computed the slow way, the debiased
squared bias is unbiased where the plain bias reads its floor, and the standard errors match the
spread over repeated experiments."""

from __future__ import annotations

import math

import pytest
import torch

from readback.bias.estimators import STATS, group_stats


def _batches(n: int, mean: torch.Tensor, noise: float, g: torch.Generator) -> torch.Tensor:
    return mean + noise * torch.randn(n, mean.numel(), generator=g, dtype=torch.float64)


def _definitions(e: torch.Tensor, r: torch.Tensor) -> dict[str, float]:
    """The statistics as the estimators' docstring defines them, by brute force."""
    n, grad = e.shape[0], r.mean(0)
    trace = sum(((row - e.mean(0)) ** 2).sum() for row in e) / (n - 1)
    debiased = (e.mean(0).pow(2).sum() - trace / n) / grad.pow(2).sum()
    projections = torch.stack([-(row @ grad) / grad.pow(2).sum() for row in e])
    relative = [(a.norm() / b.norm()).item() for a, b in zip(e, r)]
    return {
        "rel_err": sum(relative) / n,
        "rel_err_max": max(relative),
        "projection": -(e.mean(0) @ grad).item() / grad.pow(2).sum().item(),
        "projection_se": projections.std().item() / math.sqrt(n),
        "debiased_sq": debiased.item(),
        "floor": math.sqrt(trace / n) / grad.norm().item(),
    }


def _debiased_variance(e: torch.Tensor, guard: bool = True) -> float:
    """``debiased_sq_se``'s variance before dividing by ``|G|^4``, the slow way, for N = 6;
    ``guard`` False: without the plug-in's floor under the linear part."""
    n, mean = e.shape[0], e.mean(0)
    left_out = [_unbiased_squared_mean(e[torch.arange(n) != i]) for i in range(n)]
    u = torch.stack([e[0] - e[1], e[2] - e[3], e[4] - e[5]]) / math.sqrt(2)
    s2 = sum((u[j] @ u[k]) ** 2 for j in range(3) for k in range(3) if k == (j + 1) % 3).item() / 3
    direction = mean / mean.norm()
    along = sum(((row - mean) @ direction) ** 2 for row in e).item() / (n - 1)
    plug_in = 4 * max(_unbiased_squared_mean(e), 0.0) * along / n
    linear = max(_jackknife(left_out) ** 2 - 4 * s2 / (n * (n - 2)), 0.5 * plug_in if guard else 0.0, 0.0)
    return linear + 2 * s2 / (n * (n - 1))


def _unbiased_squared_mean(e: torch.Tensor) -> float:
    """``|ē|^2 - tr(Cov e) / N``, unbiased for ``|E e|^2``."""
    n = e.shape[0]
    trace = sum(((row - e.mean(0)) ** 2).sum() for row in e) / (n - 1)
    return (e.mean(0).pow(2).sum() - trace / n).item()


def test_the_guard_binds_where_the_jackknife_collapses_and_only_ever_widens():
    """Sets of 6 batches with a mean 2 floors from zero and heavy-tailed noise: in some, the
    jackknife's linear part falls below half the plug-in (to 0 in the worst), and there the SE is
    the guarded one; no set's SE is below the unguarded SE."""
    g = torch.Generator().manual_seed(3)
    mean = torch.zeros(40, dtype=torch.float64)
    mean[0] = 2 * math.sqrt(40 / 6)
    r = torch.ones(6, 40, dtype=torch.float64)
    bound = 0
    for _ in range(60):
        e = mean + torch.randn(6, 40, generator=g, dtype=torch.float64) / torch.rand(6, 1, generator=g).double()
        se = group_stats(e, r)["debiased_sq_se"] * 40
        guarded, unguarded = math.sqrt(_debiased_variance(e)), math.sqrt(_debiased_variance(e, guard=False))
        assert se == pytest.approx(guarded, rel=1e-9) and se >= unguarded * (1 - 1e-12)
        bound += guarded > unguarded * (1 + 1e-9)
    assert bound >= 3


def _jackknife(values: list[float]) -> float:
    n, mean = len(values), sum(values) / len(values)
    return math.sqrt((n - 1) / n * sum((v - mean) ** 2 for v in values))


def test_every_estimator_equals_its_definition():
    g = torch.Generator().manual_seed(0)
    e, r = _batches(6, torch.full((40,), 0.1), 0.3, g), _batches(6, torch.ones(40), 0.5, g)
    stats = group_stats(e, r)
    assert set(stats) == set(STATS)
    for key, value in _definitions(e, r).items():
        assert stats[key] == pytest.approx(value, rel=1e-12), key
    assert stats["bias_se"] == stats["floor"]  # the old key's number, under the name of what it is
    # debiased_sq_se: the U-statistic's two variance components, 4 s1 / N from the jackknife
    # (leave-one-out values recomputed) less its degenerate part, but at least half the plug-in
    # along the mean error, and 2 s2 / (N (N - 1)) from all products of the independent pair
    # differences (s2 = tr(Cov(e)^2))
    scale = r.mean(0).pow(2).sum().item()
    assert stats["debiased_sq_se"] == pytest.approx(math.sqrt(_debiased_variance(e)) / scale, rel=1e-9)
    # cosine_se: the jackknife of the cosine, both means recomputed
    cosines = [
        torch.nn.functional.cosine_similarity(e[keep].mean(0), r[keep].mean(0), dim=0).item()
        for keep in (torch.arange(6) != i for i in range(6))
    ]
    assert stats["cosine_se"] == pytest.approx(_jackknife(cosines), rel=1e-9)


def test_statistics_that_need_more_batches_are_nan():
    g = torch.Generator().manual_seed(1)
    one = group_stats(_batches(1, torch.zeros(8), 1.0, g), torch.ones(1, 8, dtype=torch.float64))
    assert all(math.isnan(one[k]) for k in ("bias_se", "floor", "projection_se", "debiased_sq", "debiased_sq_se"))
    assert math.isfinite(one["projection"])
    for n in (2, 3):
        few = group_stats(_batches(n, torch.zeros(8), 1.0, g), torch.ones(n, 8, dtype=torch.float64))
        assert math.isfinite(few["debiased_sq"]) and math.isfinite(few["projection_se"])
        assert math.isnan(few["debiased_sq_se"])  # two pair differences at least: 4 batches
    four = group_stats(_batches(4, torch.zeros(8), 1.0, g), torch.ones(4, 8, dtype=torch.float64))
    assert math.isfinite(four["debiased_sq_se"])


@pytest.mark.parametrize("true_bias", [0.0, 0.3])
def test_small_means_small_and_the_standard_errors_are_the_spread(true_bias):
    """Repeated experiments of 8 batches, G fixed: with no bias the plain bias reads the floor
    while the debiased squared bias averages to 0; with a bias along -G it averages to the bias
    squared and the projection to the bias. The projection's SE is the spread of the projection;
    the debiased squared bias's is where the bias is large, and conservative (by at most the
    docstring's 1.3) where there is none."""
    g = torch.Generator().manual_seed(2)
    grad = torch.ones(200, dtype=torch.float64) / math.sqrt(200)  # |G| = 1
    r = grad.expand(8, -1)
    runs = [group_stats(_batches(8, -true_bias * grad, 0.02, g), r) for _ in range(600)]

    def column(key: str) -> torch.Tensor:
        return torch.tensor([run[key] for run in runs], dtype=torch.float64)

    def within(key: str, expected: float) -> bool:
        """The mean over experiments is ``expected`` within 4 of its standard errors."""
        values = column(key)
        return abs(values.mean().item() - expected) < 4 * values.std().item() / math.sqrt(len(values))

    floor = 0.02 * math.sqrt(200 / 8)
    assert column("floor").mean().item() == pytest.approx(floor, rel=0.02)
    assert within("debiased_sq", true_bias**2) and within("projection", true_bias)
    assert column("projection_se").mean().item() == pytest.approx(column("projection").std().item(), rel=0.1)
    ratio = column("debiased_sq_se").mean().item() / column("debiased_sq").std().item()
    if true_bias == 0:
        assert column("bias").mean().item() == pytest.approx(floor, rel=0.05)  # the floor, not the bias
        assert 1.0 < ratio < 1.4
    else:
        assert ratio == pytest.approx(1.0, abs=0.1)
