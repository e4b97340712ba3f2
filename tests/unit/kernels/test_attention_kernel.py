"""The Triton attention core (``attention.kernel=triton``, in the interpreter) against the ops
core on the same inputs (``tests/kernel_comparison.py``): every policy's D read, nearest and
stochastic rounding, delayed and current scaling (two steps: the second on the first's delayed
scales), GQA and not, head dims 64 and 128, T within, at and past the kernel's 64-row blocks.

What is identical and what is bounded, and why. Both cores round Q, K, V, O and dO at the same
sites with the same torch code, so Q8, K8, V8 and dO8 are identical. Between them the cores differ
in the order of FP32 sums (each GEMM's, the softmax's row sum, D's) and the exponential's last
bits. Every GEMM output is rounded to BF16 (the emulated FP8 GEMM's epilogue), so an element of S,
O, dP, dQ, dK or dV can differ only where the two FP32 sums straddle a BF16 rounding point, and
then by one BF16 unit (2**-8 relative): S is held to that. P's FP32 values then differ by a few
FP32 units, or by |S| 2**-8 where S did, and P8's and O8's codes step by one where their values
sit that close to a decision point: at most a share ``_FLIPS`` of them. A GEMM output's relative
difference is then at most one BF16 unit plus a code step (2**-3 for E4M3, 2**-2 for E5M2)
times the root of the stepped share, ``_bound``; the D-term's row sums likewise, and the sites'
counts within ``_FLIPS`` of their nonzero elements. (In the interpreter the two cores' codes,
counts and O have come out identical on these inputs, and dQ, dK, dV identical or within 3e-5.)

The BF16 backward (``attention.bwd_precision=bf16``, both flavours of ``bwd_reads``) rounds dO and
dS to BF16, not FP8, and adds no count: the same sites round and count in both cores. Its GEMMs
read BF16 values (Q8, K8, V8, P8 decoded and scaled, or the original Q, K, V and the rebuilt P),
so the FP32 sum order is again the only difference (the ops core's one GEMM per block of rows,
the kernel's 64-key tiles): a GEMM output one BF16 unit apart where it straddles, and dS's BF16
values a unit apart where dP's or its own rounding did, at every element at worst
(``_gradient_bounds``: three units for dQ, dK; two for dV from the rebuilt P, whose FP32 values
differ by the LSE's sum order, the kernel's online ``log(row sum) + row max`` against
``torch.logsumexp``). Such straddles are rare: a share ``_straddles`` (4 K 2**-16 for sums of K
terms; 1/64 at K = 256) of a gradient's elements may differ at all, where a rounding left out
changes about a third of them. (In the
interpreter dQ, dK and dV have come out identical on these inputs, or a share 1e-4 of dK's.)

What dQ, dK, dP read (``bwd_qkv``) and dV, dS read (``bwd_probs``) set apart choose the operands
alone. Under the FP8 backward a GEMM of an original or a rebuilt P with dO8's or dS8's values runs
in FP32 and is not rounded (``ops.attention_backward``'s ``gemm_of``): such an output differs by
the FP32 sum order alone, at most K FP32 units (2**-24) relative, within the FP8 bounds, which
stand for dS8's code steps. (In the interpreter: within 2e-7.)

The roundings set apart (``round_grad_output``, ``round_grad_scores``, ``round_grad_output_in_d``)
choose where dO8 and dS8 stand for dO and dS, at the same sites with the same counts and scales
in both cores. Under the FP8 backward an unrounded dS's dQ and dK, and an unrounded dO's dV, are
FP32 GEMMs rounded nowhere: they differ where dS's elements do (a BF16 unit, where dP's or S's
rounding straddled: a share ``_straddles``) and by the FP32 sum order, a bound well under the
BF16 unit a rounded output would take. The BF16 backward's dO8 and dS8 enter its GEMMs as their
values rounded to BF16, as the ops core's BF16 GEMM reads them: its bounds stand. The FP32
backward (``bwd_precision=fp32``) runs every GEMM so, on Q8's, K8's, V8's and P8's values: no
output takes a BF16 unit. (In the interpreter: within 2e-7 for the FP32 outputs.)
"""

import pytest

from kernel_comparison import POLICIES, RECIPES, compare

SMALL = (1, 2, 1, 16, 64)  # (batch, heads, groups, T, head dim): every policy, recipe and rounding
# GQA and not, head dims 64 and 128, T within one of the kernel's 64-row blocks, a multiple, and
# past one (odd: the last block masked), each under one policy, recipe and rounding
SHAPES = [
    ((1, 4, 2, 24, 128), "fresh_reround", "current", "stochastic"),
    ((1, 2, 2, 128, 64), "reuse_rounded", "delayed", "nearest"),
    ((2, 2, 1, 71, 64), "no_saved_copy", "current", "stochastic"),
    ((1, 2, 1, 80, 128), "original", "delayed", "stochastic"),
    ((1, 2, 1, 256, 64), "reuse_rounded", "current", "nearest"),  # four query blocks, P's sums over 256 keys
]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_every_policy_recipe_and_rounding(monkeypatch, policy, recipe, rounding):
    compare(SMALL, policy, recipe, rounding, monkeypatch)


@pytest.mark.parametrize(
    ("shape", "policy", "recipe", "rounding"), SHAPES, ids=[f"T{c[0][3]}d{c[0][4]}H{c[0][1]}G{c[0][2]}" for c in SHAPES]
)
def test_shapes(monkeypatch, shape, policy, recipe, rounding):
    compare(shape, policy, recipe, rounding, monkeypatch)


# The BF16 backward, both flavours: every policy with each, nearest and stochastic rounding
# alternating, so that each flavour and each policy meets both; then shapes as above.
BF16_BACKWARD = [
    (policy, reads, ("nearest", "stochastic")[(i + j) % 2], ("delayed", "current")[i % 2])
    for i, policy in enumerate(POLICIES)
    for j, reads in enumerate(("forward", "te"))
]
BF16_SHAPES = [
    ((1, 4, 2, 24, 128), "fresh_reround", "current", "stochastic", "te"),
    ((1, 2, 2, 128, 64), "reuse_rounded", "delayed", "nearest", "forward"),
    ((2, 2, 1, 71, 64), "no_saved_copy", "current", "stochastic", "forward"),
    ((1, 4, 2, 128, 128), "original", "delayed", "nearest", "te"),
]


@pytest.mark.parametrize(("policy", "reads", "rounding", "recipe"), BF16_BACKWARD)
def test_bf16_backward_every_policy(monkeypatch, policy, reads, rounding, recipe):
    compare(SMALL, policy, recipe, rounding, monkeypatch, backward=dict(bwd_precision="bf16", bwd_reads=reads))


@pytest.mark.parametrize(
    ("shape", "policy", "recipe", "rounding", "reads"),
    BF16_SHAPES,
    ids=[f"{c[4]}-T{c[0][3]}d{c[0][4]}H{c[0][1]}G{c[0][2]}" for c in BF16_SHAPES],
)
def test_bf16_backward_shapes(monkeypatch, shape, policy, recipe, rounding, reads):
    compare(shape, policy, recipe, rounding, monkeypatch, backward=dict(bwd_precision="bf16", bwd_reads=reads))


# What dQ, dK, dP read (bwd_qkv) or what dV, dS read (bwd_probs) set apart from the backward's
# flavour: the originals with the forward's P, a rebuilt P with Q8, K8, V8, and both; under the
# BF16 backward, and under the FP8 one, whose GEMMs of an original or a rebuilt P run in FP32
PARTS = [
    (SMALL, "reuse_rounded", "nearest", dict(bwd_precision="bf16", bwd_qkv="original")),
    (SMALL, "original", "stochastic", dict(bwd_precision="bf16", bwd_probs="rebuilt")),
    (SMALL, "no_saved_copy", "stochastic", dict(bwd_precision="bf16", bwd_reads="te", bwd_qkv="forward")),
    (SMALL, "reuse_rounded", "nearest", dict(bwd_qkv="original")),
    (SMALL, "original", "stochastic", dict(bwd_probs="rebuilt")),
    ((1, 4, 2, 71, 128), "fresh_reround", "nearest", dict(bwd_qkv="original", bwd_probs="rebuilt")),
]


@pytest.mark.parametrize(("shape", "policy", "rounding", "parts"), PARTS, ids=[str(c[3]) for c in PARTS])
def test_parts_set_apart(monkeypatch, shape, policy, rounding, parts):
    compare(shape, policy, "delayed", rounding, monkeypatch, backward=parts)


# The roundings set apart (``attention.round_<gradient>``): the FP8 backward's dS or dO left
# unrounded (their GEMMs in FP32), the dO that D reads apart from the GEMMs' (dO8 or dO; a policy
# that reads O for D), the BF16 backward's dO or dS rounded to E5M2 (their GEMMs of BF16 values;
# dS8's scale from the whole dS under current scaling)
ROUNDINGS = [
    (SMALL, "reuse_rounded", "delayed", "nearest", dict(round_grad_scores=False)),
    (SMALL, "original", "current", "stochastic", dict(round_grad_output=False)),
    ((1, 4, 2, 71, 128), "fresh_reround", "delayed", "nearest", dict(round_grad_output_in_d=False)),
    (SMALL, "no_saved_copy", "current", "stochastic", dict(bwd_precision="bf16", round_grad_output=True)),
    (SMALL, "reuse_rounded", "current", "nearest", dict(bwd_precision="bf16", round_grad_scores=True)),
    (SMALL, "original", "delayed", "nearest", dict(bwd_precision="bf16", round_grad_output_in_d=True)),
    # the FP32 backward: every GEMM of values in FP32, dO and dS unrounded, or rounded set apart
    ((1, 4, 2, 71, 64), "no_saved_copy", "current", "stochastic", dict(bwd_precision="fp32")),
    (SMALL, "reuse_rounded", "delayed", "nearest", dict(bwd_precision="fp32", round_grad_scores=True)),
]


@pytest.mark.parametrize(
    ("shape", "policy", "recipe", "rounding", "parts"), ROUNDINGS, ids=[str(c[4]) for c in ROUNDINGS]
)
def test_roundings_set_apart(monkeypatch, shape, policy, recipe, rounding, parts):
    compare(shape, policy, recipe, rounding, monkeypatch, backward=parts)
