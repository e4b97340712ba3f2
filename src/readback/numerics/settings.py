"""The numerics settings as one component: the ``precision`` group, the ``attention`` group and
the ``policy``, with every rule between them in one ``check()``, which the config runs once and
``readback.convert`` once. ``ops.numerics_spec`` makes a run's frozen spec from them.
"""

from __future__ import annotations

from dataclasses import dataclass

from readback.errors import require
from readback.numerics.attention_settings import AttentionSettings
from readback.numerics.precision_settings import Fp8Settings, PrecisionSettings, fp8_settings
from readback.numerics.scaling import ScalingRecipe
from readback.policy import D_READS, POLICIES


@dataclass(frozen=True)
class NumericsSettings:
    """How a run rounds, as its config says: ``precision`` (``Fp8Settings`` under FP8), the
    attention core's ``attention`` and the saved-activation ``policy`` (``readback.policy``)."""

    precision: PrecisionSettings
    attention: AttentionSettings
    policy: str

    @property
    def fp8(self) -> Fp8Settings | None:
        """The FP8 settings, None without FP8."""
        return fp8_settings(self.precision)

    def recipe(self) -> ScalingRecipe | None:
        """The linears' recipe object (``Fp8Settings.scaling_recipe``), None without FP8."""
        return self.fp8.scaling_recipe() if self.fp8 else None

    def check(self) -> None:
        """The rules between the groups (each group has checked its own fields): the policy is one
        of ``POLICIES``; an amax spike needs delayed scaling; ``attention.recipe`` and the backward's
        parts are an FP8 run's; ``exact`` reads the forward's operands; ``bwd_reads=te`` is a BF16
        backward's after an FP8 forward."""
        a, policy, fp8 = self.attention, self.policy, self.fp8 is not None
        require(policy in POLICIES, "policy", policy, ", ".join(POLICIES))
        require(a.recipe is None or fp8, a.key("recipe"), a.recipe, "null under precision=bf16 (no FP8 core)")
        for key, value in a.parts_set_apart().items():
            require(fp8, a.key(key), value, "null under precision=bf16 (no FP8 forward to read apart from)")
            require(policy != "exact", a.key(key), value, "null with policy=exact (it reads the forward's operands)")
        self._check_amax_spike()
        in_d = a.round_grad_output_in_d  # D = rowsum(P * dP) reads no dO of D's own
        require(
            in_d is None or D_READS[policy] != "none",
            a.key("round_grad_output_in_d"),
            in_d,
            f"null: policy={policy}'s D reads no O",
        )
        if a.bwd_reads == "forward":
            return
        why = (
            (a.bwd_precision != "bf16", f"with bwd_precision={a.bwd_precision}: te is a BF16 backward's reads"),
            (not fp8, "with precision=bf16: without FP8 the originals are what the forward multiplied"),
            (policy == "exact", "with policy=exact, which reads what the forward multiplied"),
        )
        reason = next((text for bad, text in why if bad), None)
        require(reason is None, a.key("bwd_reads"), a.bwd_reads, f"forward ({reason})")

    def _check_amax_spike(self) -> None:
        """Only delayed scaling keeps an amax history to hold a spike: the linears' recipe or the
        attention core's own."""
        p = self.fp8
        if p is None or p.amax_spike is None:
            return
        require(
            "delayed" in (p.recipe, self.attention.recipe),
            p.key("amax_spike"),
            dict(p.amax_spike),
            f"null under precision.recipe={p.recipe}, or attention.recipe=delayed for the attention "
            "core's sites (only delayed scaling keeps an amax history to hold a spike)",
        )
