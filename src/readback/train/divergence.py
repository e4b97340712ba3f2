"""Divergence detection: non-finite losses, loss blow-ups and non-finite gradients.

* A NaN/Inf training loss stops the run at once: :meth:`DivergenceDetector.check_loss` returns
  ``True`` and the trainer does not apply that step's update.
* A logged loss above ``factor`` x the running minimum of the earlier logged losses, for
  ``patience`` consecutive logged steps, marks ``diverged_at_step`` as the first step of that
  streak; :meth:`DivergenceDetector.observe_logged` returns ``True`` (stop) only when ``stop``.
* A step with non-finite gradients (and a finite loss) is not applied either. With
  ``nonfinite_grads: stop`` (the default) it is a divergence like a NaN loss: the run stops,
  ``diverged_at_step`` is that step. With ``skip`` the update is skipped, the step and parameter
  names are recorded in ``skipped``, and training continues.
* ``nonfinite_tensors`` names what was not finite at the step that stopped the run: ``loss``
  and/or ``<parameter>.grad``.

All ranks feed the detector the same all-reduced numbers, so they reach the same verdicts.
"""

from __future__ import annotations

import math
from typing import Any

from readback.train.settings import Divergence


class DivergenceDetector:
    """The verdicts of the ``trainer.divergence`` group's settings."""

    def __init__(self, settings: Divergence):
        self.factor, self.patience = settings.factor, settings.patience
        self.stop, self.nonfinite_grads = settings.stop, settings.nonfinite_grads
        self.nonfinite_tensors: list[str] = []
        self.running_min = math.inf
        self.streak_start: int | None = None
        self.streak_len = 0
        self.diverged_at_step: int | None = None
        self.reason: str | None = None
        self.skipped: list[dict[str, Any]] = []

    @property
    def diverged(self) -> bool:
        return self.diverged_at_step is not None

    def check_loss(self, step: int, loss: float) -> bool:
        """Per-step check of the training loss; ``True`` when it is NaN/Inf (stop now)."""
        if math.isfinite(loss):
            return False
        if self.diverged_at_step is None:
            self.diverged_at_step = step
        self.reason = f"non-finite loss ({loss}) at step {step}"
        return True

    def check_grads(self, step: int, names: list[str]) -> bool:
        """Non-finite gradients of parameters ``names`` at ``step`` (a finite loss): ``True`` when
        the run stops (``nonfinite_grads: stop``); with ``skip`` the step is recorded in ``skipped``."""
        if self.nonfinite_grads == "skip":
            self.record_nonfinite_grads(step, names)
            return False
        if self.diverged_at_step is None:
            self.diverged_at_step = step
        self.nonfinite_tensors = [f"{n}.grad" for n in names]
        self.reason = f"non-finite gradients at step {step}: {', '.join(names) or '?'}"
        return True

    def record_nonfinite_tensors(self, names: list[str]) -> None:
        """What was not finite at the step that stopped the run (``loss``, ``<param>.grad``)."""
        self.nonfinite_tensors = list(names)

    def observe_logged(self, step: int, loss: float) -> bool:
        """Check a logged loss against ``factor`` x running minimum; ``True`` means stop."""
        if not math.isfinite(loss):
            return self.check_loss(step, loss)
        if math.isfinite(self.running_min) and loss > self.factor * self.running_min:
            if self.streak_len == 0:
                self.streak_start = step
            self.streak_len += 1
        else:
            self.streak_len, self.streak_start = 0, None
        self.running_min = min(self.running_min, loss)
        if self.streak_len >= self.patience and self.diverged_at_step is None:
            self.diverged_at_step = self.streak_start
            self.reason = (
                f"loss above {self.factor} x running minimum ({self.running_min:.4g}) for "
                f"{self.patience} logged steps from step {self.streak_start}"
            )
        return self.stop and self.diverged

    def record_nonfinite_grads(self, step: int, names: list[str]) -> None:
        """Remember a step whose update was skipped because these gradients were non-finite."""
        self.skipped.append({"step": int(step), "params": list(names)})

    def state_dict(self) -> dict[str, Any]:
        return {
            "running_min": self.running_min,
            "streak_start": self.streak_start,
            "streak_len": self.streak_len,
            "diverged_at_step": self.diverged_at_step,
            "reason": self.reason,
            "skipped": [dict(s) for s in self.skipped],
            "nonfinite_tensors": list(self.nonfinite_tensors),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.running_min = float(state["running_min"])
        self.streak_start = state["streak_start"]
        self.streak_len = int(state["streak_len"])
        self.diverged_at_step = state["diverged_at_step"]
        self.reason = state["reason"]
        self.skipped = [dict(s) for s in state["skipped"]]
        self.nonfinite_tensors = list(state.get("nonfinite_tensors", []))
