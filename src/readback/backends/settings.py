"""The ``backend`` group's schema, and ``model=hf``'s (a transformers model converted to a
backend's parts).
"""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import MISSING

from readback.backends import BACKENDS
from readback.backends.te_plan import ATTENTION_CORES
from readback.fields import Checked, one_of
from readback.model.settings import Model


@dataclass
class HfModel(Model):
    """``model=hf``: a transformers causal LM of these sizes, converted by ``readback.convert``."""

    architecture: str = one_of(("llama",))
    filter: list[str] = MISSING  # module-name patterns left in high precision

    def check(self) -> None:
        from readback.backends.hf import check_available

        super().check()
        check_available()


@dataclass
class Backend(Checked):
    KEY = "backend"
    name: str = one_of(BACKENDS)


@dataclass
class TeBackend(Backend):
    attention_core: str = one_of(ATTENTION_CORES)
    fp8_mha: bool = MISSING
