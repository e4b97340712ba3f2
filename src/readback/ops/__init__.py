"""Autograd ops whose every backward read is declared in a ``READS`` table next to the backward.

Import the functions from their modules: ``readback.ops.linear.linear``,
``readback.ops.norm.rms_norm``, ``readback.ops.attention.attention``, ``readback.ops.activation.xielu``.
"""

from readback.ops import activation, attention, linear, norm
from readback.ops.numerics import ATTENTION_BWD, PRECISIONS, Numerics, build_numerics
from readback.ops.site import Site

# Every op module (with its READS table), by the name policy tables and the audit use.
OPS = {"linear": linear, "rms_norm": norm, "attention": attention, "xielu": activation}


def read_rules(policy: str) -> dict[str, dict[str, str]]:
    """``{op: {gradient: read mode}}`` of every op under ``policy``."""
    return {name: dict(op.READS[policy]) for name, op in OPS.items()}


__all__ = ["ATTENTION_BWD", "OPS", "PRECISIONS", "Numerics", "Site", "build_numerics", "read_rules"]
