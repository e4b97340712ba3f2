"""Per-tensor scales: one scale from an amax (as Transformer Engine computes it) and the state that
holds a tensor's scale between steps (and, under delayed scaling, its amax history), which a
checkpoint saves.
"""

from __future__ import annotations

from typing import Any

import torch

from readback.numerics.formats import FP8Format
from readback.numerics.scaling import DelayedScaling, ScalingRecipe


def abs_max(x: torch.Tensor) -> torch.Tensor:
    """``x.abs().amax()`` (NaN if ``x`` holds one), in ``x``'s dtype, from one pass that allocates
    nothing. A compiled graph fuses the ``abs`` into the reduction's loop, where one accumulator
    costs less than ``aminmax``'s two."""
    if torch.compiler.is_compiling():
        return x.detach().abs().amax().abs()  # the outer abs: a positive NaN, as eager gives
    low, high = torch.aminmax(x.detach())
    return torch.maximum(-low, high).abs()  # abs: an all-zero x gives +0, as x.abs().amax() does


def compute_scale(
    amax: torch.Tensor, fmt: FP8Format, margin: int = 0, previous: torch.Tensor | float = 1.0
) -> torch.Tensor:
    """``(fmt.max * 2**-margin) / amax``, one correctly rounded FP32 division as Transformer
    Engine's scale update computes it (``scaled_max / amax``). A Python number over a tensor would
    not do: torch evaluates it as a reciprocal times the number, two roundings, one ulp off for
    about a quarter of amaxes.

    Where that is not a usable scale (amax zero or non-finite, or a scale that overflows fp32)
    the ``previous`` scale is kept, as Transformer Engine does: an all-zero tensor or one NaN must
    not poison every later step with an inf/NaN scale.
    """
    amax = torch.as_tensor(amax, dtype=torch.float32)
    previous = torch.as_tensor(previous, dtype=torch.float32, device=amax.device)
    scale = amax.new_tensor(fmt.max * 2.0**-margin) / amax
    usable = (amax > 0) & torch.isfinite(amax) & torch.isfinite(scale)
    return torch.where(usable, scale, previous)


class DelayedScalingState:
    """One tensor's amax history (a ring buffer) and scale.

    Within a step every quantization uses the same scale and the step's amax is the max over
    them; ``end_step`` writes that amax into the history and, every ``interval`` steps,
    recomputes the scale from the history. A step here is one optimizer step (``Numerics.end_step``
    runs once after it), all its micro-batches' amaxes in one entry: the history holds
    ``amax_history_len`` optimizer steps, where Transformer Engine writes one entry per forward
    (micro-batch), so with ``accum`` micro-batches a TE history of ``L`` spans ``L / accum`` steps.
    """

    def __init__(self, recipe: DelayedScaling, fmt: FP8Format):
        self.recipe, self.fmt = recipe, fmt
        self.history = torch.zeros(recipe.amax_history_len)
        self.scale = torch.ones(())
        self.steps = 0  # steps recorded so far; the newest amax sits at (steps - 1) % len
        self.pending_amax = torch.zeros(())  # this step's amax so far, written at end_step

    def scale_for(self, x: torch.Tensor, amax: torch.Tensor | None = None) -> torch.Tensor:
        """The step's scale; ``x``'s amax (``abs_max(x)``, computed here unless given) joins the step's."""
        if self.scale.device != x.device:  # follow the model to its device, once
            self.history, self.scale, self.pending_amax = (
                t.to(x.device) for t in (self.history, self.scale, self.pending_amax)
            )
        amax = abs_max(x) if amax is None else amax
        torch.maximum(self.pending_amax, amax.float(), out=self.pending_amax)  # in place: a compiled backward can
        return self.scale

    def end_step(self) -> None:
        """Tensors change in place: a compiled step reads them as its inputs, and a new tensor
        object would have it compiled again."""
        self.history[self.steps % len(self.history)] = self.pending_amax
        self.steps += 1
        self.pending_amax.zero_()
        if self.steps % self.recipe.interval == 0:
            self.scale.copy_(compute_scale(self.history_amax(), self.fmt, self.recipe.margin, self.scale))

    def history_amax(self) -> torch.Tensor:
        """The amax the scale is computed from: the history's max (``max``) or its newest entry
        (``most_recent``). With ``interval`` 1 it is the amax behind the scale in use."""
        if self.recipe.amax_compute_algo == "max":
            return self.history.max()
        return self.history[(self.steps - 1) % len(self.history)]

    def state_dict(self) -> dict[str, Any]:
        return {"history": self.history.clone(), "scale": self.scale.clone(), "steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "history" not in state:
            raise ValueError("the checkpoint holds no amax history for this delayed-scaling tensor (another recipe's)")
        if state["history"].shape != self.history.shape:
            raise ValueError(
                f"amax history length {len(state['history'])} in checkpoint, {len(self.history)} in recipe"
            )
        self.history.copy_(state["history"])
        self.scale.copy_(state["scale"])
        self.steps = int(state["steps"])
        self.pending_amax.zero_()


class CurrentScalingState:
    """Scale of the tensor being quantized now; keeps the last scale as the fallback."""

    def __init__(self, recipe: ScalingRecipe, fmt: FP8Format):
        self.recipe, self.fmt = recipe, fmt
        self.scale = torch.ones(())

    def scale_for(self, x: torch.Tensor, amax: torch.Tensor | None = None) -> torch.Tensor:
        amax = (abs_max(x) if amax is None else amax).float()
        scale = compute_scale(amax, self.fmt, self.recipe.margin, self.scale.to(amax.device))
        if self.scale.device == scale.device:  # kept in place (a compiled backward cannot rebind it)
            self.scale.copy_(scale)
        else:
            self.scale = scale.clone()
        return scale

    def end_step(self) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale.copy_(state["scale"])


def new_state(recipe: ScalingRecipe, fmt: FP8Format) -> DelayedScalingState | CurrentScalingState:
    """One tensor's scaling state under a per-tensor ``recipe``: scaled by its own amax when it is
    quantised, unless the recipe keeps a history (``DelayedScaling``)."""
    return DelayedScalingState(recipe, fmt) if isinstance(recipe, DelayedScaling) else CurrentScalingState(recipe, fmt)
