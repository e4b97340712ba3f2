"""The ``probe`` group's schema: how often the gradient probe and the bias meter measure."""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import MISSING

from readback.fields import Checked, integer, one_of
from readback.probe.gradient_error import DTYPES


@dataclass
class Probe(Checked):
    KEY = "probe"
    every: int = integer(minimum=0)  # 0: off
    repeats: int = integer()
    dtype: str = one_of(DTYPES)
    params: list[str] = MISSING
    bias_every: int = integer(minimum=0)  # 0: off
    bias_batches: int = integer()
