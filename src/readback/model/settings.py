"""The ``model`` group's schema: the FOG's sizes and the batch they train on (``fog_config``
turns it into the model's own ``FOGConfig``).
"""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import MISSING

from readback.errors import require
from readback.fields import Checked, integer, number


@dataclass
class Model(Checked):
    KEY = "model"
    name: str = MISSING
    n_layers: int = integer()
    d_model: int = integer()
    n_heads: int = integer()
    n_kv_groups: int = integer()
    ffn_dim: int = integer()
    vocab_size: int | None = integer()  # null: the data's tokenizer decides
    tied: bool = MISSING
    seq_len: int = integer()
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
