"""Autograd ops whose every backward read is declared in a ``READS`` table next to the backward.

Import the functions from their modules: ``readback.ops.linear.linear``,
``readback.ops.norm.rms_norm``, ``readback.ops.attention.attention``, ``readback.ops.activation.xielu``.
``numerics_spec`` makes a run's frozen ``NumericsSpec`` from its settings, the ops' read rules
under its policy resolved; ``Numerics(spec, seed=...)`` runs it.
"""

from __future__ import annotations

from readback.numerics import ScalingRecipe
from readback.numerics.attention_settings import AttentionSettings
from readback.numerics.settings import NumericsSettings
from readback.numerics.spec import NumericsSpec
from readback.ops import activation, attention, linear, norm

# Every op module (with its READS table), by the name policy tables and the audit use.
OPS = {"linear": linear, "rms_norm": norm, "attention": attention, "xielu": activation}


def read_rules(
    policy: str, flavour: AttentionSettings | None = None, recipe: ScalingRecipe | None = None
) -> dict[str, dict[str, str]]:
    """``{op: {gradient: read mode}}`` of every op under ``policy``, with the attention backward's
    flavour (``flavour.bwd_reads``: ``attention.BWD_READS``) and its parts set apart (``bwd_qkv``:
    what dQ, dK, dP read of Q, K, V; ``bwd_probs``: what dV, dS read of P) laid over attention's
    row, and the reads ``recipe`` sets (``linear.recipe_reads``: a block recipe's own copies, a
    backward_override's) over the linear's. ``exact`` takes none: it is every gradient reading
    what its forward used, whatever the backward reads otherwise."""
    rules = {name: dict(op.READS[policy]) for name, op in OPS.items()}
    if policy != "exact":
        laid = dict(attention.BWD_READS[flavour.bwd_reads if flavour else "forward"])
        parts = (flavour.bwd_qkv, flavour.bwd_probs) if flavour else (None, None)
        for gradients, part in zip((attention.QKV_READERS, attention.P_READERS), parts):
            if part is not None:  # "forward": the policy's own read, whatever the flavour
                laid |= {g: rules["attention"][g] if part == "forward" else part for g in gradients}
        rules["attention"] |= laid
        rules["linear"] |= linear.recipe_reads(recipe)
    return rules


def numerics_spec(settings: NumericsSettings) -> NumericsSpec:
    """The spec of a run of ``settings``: its policy's reads from the ops' tables, in its attention
    backward's flavour, with its recipe's (``read_rules``)."""
    return NumericsSpec(settings, read_rules(settings.policy, settings.attention, settings.recipe()))


__all__ = ["OPS", "numerics_spec", "read_rules"]
