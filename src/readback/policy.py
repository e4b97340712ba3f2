"""The study's saved-activation policies.

A policy names one read mode per (op, gradient). Each op declares its own table, ``READS``,
next to its backward, and its backward looks its reads up there; this module names the policies
(``readback.ops.read_rules`` gathers the tables, for validation, the audit and the docs).
"""

from __future__ import annotations

# "rebuilt": a value the backward recomputes from other reads than the forward's (attention's P,
# rebuilt from the original Q, K with the FP8 forward's log-sum-exp: ops.attention.BWD_READS)
# "requantized": the original quantised again along the reading GEMM's own axis (a block recipe's
# other direction: ops.linear.BLOCK_DIRECTIONS); a per-tensor copy serves both, so it is "rounded" there
# "rotated": requantized after NVFP4's 16-point Hadamard transform along that axis (its wgrad X copy)
READ_MODES = ("rounded", "original", "fresh", "none", "rebuilt", "requantized", "rotated")

POLICIES = {
    "reuse_rounded": "attention D-term reads the FP8 output O8 saved for the projection's wgrad "
    "(what Transformer Engine's delayed-scaling FP8 attention does)",
    "fresh_reround": "attention D-term reads a fresh stochastic rounding of the saved original O",
    "no_saved_copy": "attention D = rowsum(P * dP): no copy of O is saved for it (the control)",
    "original": "attention D-term reads the high-precision O (Transformer Engine current scaling)",
    "exact": "every gradient reads what its forward used: the gradient of the executed forward",
}
# What each policy's attention D-term (D = rowsum(dO * O)) reads: the one read the policies differ
# in (ops.attention.READS takes its D column from here; "none": D = rowsum(P * dP), no O read).
D_READS = {
    "reuse_rounded": "rounded",  # the O8 saved for the projection's wgrad
    "fresh_reround": "fresh",  # a new stochastic rounding of the saved O
    "no_saved_copy": "none",  # rowsum(P * dP): exact, reads no O
    "original": "original",  # high-precision O (off by P's rounding)
    "exact": "none",
}
assert tuple(D_READS) == tuple(POLICIES)
