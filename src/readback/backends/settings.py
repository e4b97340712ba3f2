"""The ``backend`` group's schema, and :class:`ModelSettings`, what of a run's configuration a
backend builds a model from (``model=hf``'s schema is ``backends.hf.HfModel``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from omegaconf import MISSING

from readback.fields import Checked, one_of
from readback.model.settings import Model
from readback.numerics.attention_settings import AttentionSettings
from readback.numerics.precision_settings import PrecisionSettings
from readback.numerics.settings import NumericsSettings

BACKENDS = ("emulated", "te")
ATTENTION_CORES = ("auto", "readback")  # backend=te: auto (TE's where it can run the experiment) | readback


@dataclass
class Backend(Checked):
    KEY = "backend"
    name: str = one_of(BACKENDS)


@dataclass
class TeBackend(Backend):
    attention_core: str = one_of(ATTENTION_CORES)
    fp8_mha: bool = MISSING


class ModelSettings(Protocol):
    """The groups of a run's configuration a model is built from: ``readback.train.settings.Config``
    (which sits above the backends) has them, and so does any object with these attributes."""

    @property
    def seed(self) -> int: ...
    @property
    def model(self) -> Model: ...
    @property
    def precision(self) -> PrecisionSettings: ...
    @property
    def policy(self) -> str: ...
    @property
    def attention(self) -> AttentionSettings: ...
    @property
    def backend(self) -> Backend: ...
    @property
    def numerics(self) -> NumericsSettings: ...
