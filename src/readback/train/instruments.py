"""The bias meter (:mod:`readback.bias`) inside training, every ``probe.bias_every`` steps."""

from __future__ import annotations

from typing import Any


class TrainingBiasMeter:
    def __init__(self, cfg: Any):
        self.bias_every, self.bias_batches = cfg.probe.bias_every, cfg.probe.bias_batches
        self.pending: dict[str, float] = {}

    def due(self, step: int) -> bool:
        return self.bias_every > 0 and step % self.bias_every == 0

    def measure(self, step: int, model: Any, stream: Any) -> None:
        """On bias steps: the bias meter over the first ``probe.bias_batches`` validation
        batches, at this step's weights and scales, leaving the run as it was."""
        if not self.due(step):
            return
        from readback.bias import measure_bias

        device = next(model.parameters()).device
        batches = [(x.to(device), y.to(device)) for x, y in stream.val_batches(self.bias_batches)]
        self.pending = measure_bias(model, batches).metrics()

    def pop(self) -> dict[str, float]:
        """The bias meter's ``grad_bias*/<variant>/<group>`` keys, once, if measured since the last record."""
        found, self.pending = self.pending, {}
        return found
