"""The ``probe`` group's schema: how often the gradient probe and the bias meter measure."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from omegaconf import MISSING

from readback.fields import Checked, integer, one_of

DTYPES = {"fp32": torch.float32, "fp64": torch.float64}  # the reference replay's precision


@dataclass
class Probe(Checked):
    KEY = "probe"
    every: int = integer(minimum=0)  # 0: off
    repeats: int = integer()
    dtype: str = one_of(DTYPES)
    params: list[str] = MISSING
    bias_every: int = integer(minimum=0)  # 0: off
    bias_batches: int = integer()
