"""The ops' mechanism statistics of one run: running moments and maxima per key, in FP64.

Kept as tensors changed in place, so a compiled backward can add to them, and saved in
checkpoints, so a resume between two log records logs what the uninterrupted run would have.
"""

from __future__ import annotations

from typing import Any

import torch


class Observations:
    def __init__(self) -> None:
        self.moments: dict[str, torch.Tensor] = {}  # key -> (count, sum, sum of squares)
        self.maxima: dict[str, torch.Tensor] = {}

    def observe(self, key: str, values: torch.Tensor) -> None:
        """Accumulate count, sum and sum of squares of ``values`` under ``key`` (in FP64).

        A key's moments are added in place once it exists (a compiled backward can only write
        into existing tensors); a popped key stays, at count 0, for the same reason."""
        v = values.detach().to(torch.float64).flatten()
        moments = torch.stack(
            [torch.tensor(float(v.numel()), dtype=torch.float64, device=v.device), v.sum(), v.square().sum()]
        )
        self.observe_moments(key, moments)

    def observe_moments(self, key: str, moments: torch.Tensor) -> None:
        """Add moments (count, sum, sum of squares; FP64) summed elsewhere, as ``observe`` adds
        its values' (a kernel's per-row sums, whose values are never held)."""
        slot = self.moments.get(key)
        if slot is None or slot.device != moments.device:  # (a resumed run's moments come back on the CPU)
            self.moments[key] = moments if slot is None else moments + slot.to(moments.device)
        else:
            slot.add_(moments)

    def observe_max(self, key: str, value: torch.Tensor) -> None:
        """Keep the largest ``value`` under ``key`` (popped as ``<kind>/max/<site>``)."""
        value = value.detach().to(torch.float64)
        self.maxima[key] = torch.maximum(self.maxima[key].to(value.device), value) if key in self.maxima else value

    def pop(self) -> dict[str, float]:
        """``{"<kind>/mean/<site>": mean, "<kind>/z/<site>": mean / standard error}`` of everything
        observed since the last call (and ``<kind>/max/<site>`` of ``observe_max``), then forget
        it. The z-score tests "mean is zero"; it needs two values at least, so a quantity observed
        once (one cosine per layer and step) has a mean only."""
        stats = {}
        for key, value in self.maxima.items():
            kind, site = key.split("/", 1)
            stats[f"{kind}/max/{site}"] = float(value)
        self.maxima.clear()
        for key, (count, total, squares) in ((k, m.tolist()) for k, m in self.moments.items()):
            if count == 0:
                continue
            kind, site = key.split("/", 1)
            mean = total / count
            variance = max(squares / count - mean * mean, 0.0) * count / max(count - 1, 1)
            stats[f"{kind}/mean/{site}"] = mean
            if count >= 2:
                stats[f"{kind}/z/{site}"] = mean / (variance / count) ** 0.5 if variance > 0 else 0.0
        for moments in self.moments.values():
            moments.zero_()
        return stats

    def state_dict(self) -> dict[str, Any]:
        """What was observed since the last ``pop`` (keys at count 0 left out)."""
        return {
            "observations": {key: m.clone() for key, m in self.moments.items() if m[0] > 0},
            "maxima": dict(self.maxima),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for moments in self.moments.values():
            moments.zero_()
        for key, moments in state.get("observations", {}).items():
            self.observe_moments(key, moments.clone())
        self.maxima = dict(state.get("maxima", {}))
