"""The ``model`` group's schema: the FOG's sizes and the batch they train on (``fog_config``
turns it into the model's own ``FOGConfig``, which shares its ``Sizes``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from omegaconf import MISSING

from readback.errors import require
from readback.fields import Checked, integer, number


def size() -> Any:
    """An integer >= 1 that must be given (no default), so the classes built on ``Sizes`` may add
    fields with defaults after it."""
    return integer(default=dataclasses.MISSING)


@dataclass
class Sizes:
    """The sizes of a transformer, declared once for the schema (``Model``), the FOG
    (``FOGConfig``) and a ``model=hf`` Llama."""

    n_layers: int = size()
    d_model: int = size()
    n_heads: int = size()
    n_kv_groups: int = size()
    ffn_dim: int = size()
    vocab_size: int | None = size()  # null in the schema: the data's tokenizer decides
    seq_len: int = size()

    def sizes(self) -> dict[str, Any]:
        """``{field: value}`` of the sizes alone, to build another class on ``Sizes`` from this one."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(Sizes)}


@dataclass
class Model(Checked, Sizes):
    KEY = "model"
    name: str = MISSING
    tied: bool = MISSING
    global_batch: int = integer()
    lr: float = number(0, low_open=True)

    def check(self) -> None:
        require(
            self.d_model % self.n_heads == 0,
            "model.n_heads",
            self.n_heads,
            f"a divisor of model.d_model={self.d_model}",
        )
        require(
            self.n_heads % self.n_kv_groups == 0,
            "model.n_kv_groups",
            self.n_kv_groups,
            f"a divisor of model.n_heads={self.n_heads}",
        )
