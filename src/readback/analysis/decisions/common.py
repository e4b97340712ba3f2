"""What the pre-registered decisions share: the seed x arm table of final losses, the side a
paired contrast falls on, a meter figure pooled over seeds, and a figure written to its SE."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import pandas as pd

from readback.analysis.paired import mean_se
from readback.analysis.render import se_digits

ENDED = ("completed", "diverged")  # a diverged run counts with its last value, as each test registered


def seed_table(
    runs: pd.DataFrame, column: str, arms: Sequence[str], by: str = "experiment", statuses: Sequence[str] = ENDED
) -> pd.DataFrame:
    """Seed x arm table of ``column`` (arms told apart by ``by``) over the seeds whose arms all
    ended with one of ``statuses``."""
    ended = runs[runs["status"].isin(statuses)]
    return ended.pivot_table(index="seed", columns=by, values=column).reindex(columns=list(arms)).dropna()


def diverged_rule(first: str, second: str) -> str:
    """The call made with the diverged runs (``first``), unless the call without the seeds they
    are in (``second``) differs: then inconclusive, as registered."""
    if first == second:
        return first
    return f"inconclusive: the calls with and without diverged runs differ ({first}; {second})"


def side(p: dict) -> str:
    """``behind`` (t at or above the two-sided 5 % point), ``ahead`` (at or below minus it) or ``none``."""
    t, t2 = p["t"], p["t_two_sided"]
    return "behind" if t >= t2 else "ahead" if t <= -t2 else "none"


def over_seeds(values: Iterable[float]) -> dict:
    """``{n, mean, se}`` of the finite ``values`` (one a seed; a missing one is NaN)."""
    found = np.array(list(values), dtype=float)
    found = found[np.isfinite(found)]
    mean, se = mean_se(found)
    return {"n": len(found), "mean": mean, "se": se}


def figure(mean: float, se: float) -> str:
    """``mean ± se``, the SE to two significant digits and the mean to the same place."""
    n = se_digits(se)
    return f"{mean:+.{n}f} ± {se:.{n}f}"
