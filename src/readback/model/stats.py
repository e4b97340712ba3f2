"""Per-layer activation statistics, collected by forward hooks: the model returns only its loss.

Kurtosis over the hidden dimension, averaged over tokens, of each layer's attention-core output
(``attn_out``) and FFN input (``ffn_in``): large when a few channels carry outliers, the FOG
paper's early sign of FP8 divergence (3 for a Gaussian). The logged value is the largest over
layers, ``kurtosis/<tensor>_max``.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import torch
import torch.nn as nn

# module name -> tensor watched: the core's output, and the MLP's input
_WATCHED = (
    (re.compile(r"(?:.*\.)?layers\.\d+\.attn\.core"), "attn_out"),
    (re.compile(r"(?:.*\.)?layers\.\d+\.mlp"), "ffn_in"),
)


def kurtosis(x: torch.Tensor) -> float:
    """Kurtosis over the last dimension, averaged over the other ones (3 for a Gaussian)."""
    x = x.detach()
    if type(x) is not torch.Tensor:  # a backend's FP8 tensor subclass (TE's Float8Tensor): its values
        x = x.dequantize()
    x = x.float()
    centered = x - x.mean(-1, keepdim=True)
    var = centered.pow(2).mean(-1)
    return (centered.pow(4).mean(-1) / var.clamp_min(1e-30).pow(2)).mean().item()


class ActivationStats:
    """Hooks on every ``layers.<i>.attn.core`` and ``layers.<i>.mlp`` of ``model`` (any backend's
    FOG; a model without them yields no statistics). Measures only while ``active`` is true:
    each measurement costs a device sync per layer."""

    def __init__(self, model: nn.Module):
        self.active = False
        self._values: dict[str, list[float]] = {}
        for name, module in model.named_modules():
            for pattern, key in _WATCHED:
                if pattern.fullmatch(name):
                    watch_output = key == "attn_out"
                    hook = self._output_hook(key) if watch_output else self._input_hook(key)
                    (module.register_forward_hook if watch_output else module.register_forward_pre_hook)(hook)

    def _output_hook(self, key: str):
        def hook(module, inputs, output):
            if self.active:
                self._values.setdefault(key, []).append(kurtosis(output[0] if isinstance(output, tuple) else output))

        return hook

    def _input_hook(self, key: str):
        def hook(module, inputs):
            if self.active:
                self._values.setdefault(key, []).append(kurtosis(inputs[0]))

        return hook

    @contextlib.contextmanager
    def measuring(self, on: bool = True) -> Iterator[None]:
        """Measure in the block when ``on`` (as ``Numerics.measuring`` does for the ops)."""
        saved, self.active = self.active, on
        try:
            yield
        finally:
            self.active = saved

    def pop(self) -> dict[str, float]:
        """``{"kurtosis/<tensor>_max": largest over layers}`` measured since the last call."""
        stats = {f"kurtosis/{key}_max": max(values) for key, values in self._values.items()}
        self._values.clear()
        return stats
