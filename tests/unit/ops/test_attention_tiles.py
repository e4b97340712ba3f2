"""The attention core in query blocks: the same codes and gradients as the op before it was
tiled (``tests/frozen_attention.py``, frozen at commit c264a60) under nearest rounding; draws
keyed by position under stochastic rounding (unbiased, seeded, the same whatever the blocks);
and at T 4,096 the exact policies against the reference, with no T x T tensor saved."""

from __future__ import annotations

import pytest
import torch

import frozen_attention
from readback.numerics import CurrentScaling, DelayedScaling, MXFP8BlockScaling, QTensor
from readback.numerics.formats import E4M3
from readback.numerics.rounding import KeyedDraws, quantize
from readback.numerics.site import Site
from readback.numerics.state import Numerics
from readback.ops import attention_parts
from readback.ops.attention import attention, replay
from readback.policy import POLICIES
from specs import make_spec

NAME = "layers.0.attn.core"  # a core's name: attention.recipe scales its sites
B, H, G, HD = 2, 4, 2, 16
# (linears' recipe, attention.recipe): delayed scaling warmed up a step, current, a block recipe
# whose attention core is per-tensor, and a core with a recipe of its own
RECIPES = {
    "delayed": (DelayedScaling(), None),
    "current": (CurrentScaling(), None),
    "mxfp8": (MXFP8BlockScaling(), None),
    "delayed+current": (DelayedScaling(), "current"),
}
GRADIENT_OBSERVATIONS = ("attn_grad_flushed/", "attn_grad_subnormal/", "attn_grad_amax_to_rms/")
FLAVOURS = [("fp8", "forward"), ("bf16", "forward"), ("fp32", "forward"), ("bf16", "te"), ("fp32", "te")]


def _inputs(seq: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, seq, HD, generator=g) * 2
    k, v = (torch.randn(B, G, seq, HD, generator=g) for _ in range(2))
    return q, k, v, torch.randn(B, seq, H * HD, generator=g)


def _run(op, numerics, x, monkeypatch) -> tuple[list, list]:
    """Two steps (the second on the first's delayed scales) of ``op``: every rounding it counted
    (site, codes, scale), the gradients, the counts and the observations."""
    rounded: list = []
    quantize_at = Site.quantize

    def spy(self, t, *args, **kwargs):
        q = quantize_at(self, t, *args, **kwargs)
        if kwargs.get("count", True):  # the tiled backward's P8 again: not a rounding of its own
            rounded.append((self.name, q.data.view(torch.uint8) if q.data.element_size() == 1 else q.data, q.scale))
        return q

    monkeypatch.setattr(Site, "quantize", spy)
    results = []
    for step in range(2):
        q, k, v = (t.clone().requires_grad_() for t in x[:3])
        with numerics.measuring(step == 1):
            o, _ = op(q, k, v, numerics, NAME)
            o.backward(x[3])
        numerics.end_step()
        results += [o, q.grad, k.grad, v.grad]
    counts = [numerics.saturation_counts(), numerics.underflow_fractions(), numerics.pop_observations()]
    monkeypatch.setattr(Site, "quantize", quantize_at)
    return _whole(rounded, x[0].shape[2]), [*results, *counts]


def _whole(rounded: list, seq: int) -> list:
    """The roundings of a site's blocks of rows (B, H, rows, keys) as one (B, H, T, T) call,
    the columns no block computed as zeros."""
    out: list = []
    for site, codes, scale in rounded:
        if site.endswith((".probs", ".grad_scores")):
            codes = torch.nn.functional.pad(codes, (0, seq - codes.shape[-1]))
            if out and out[-1][0] == site and out[-1][1].shape[2] < seq:
                out[-1] = (site, torch.cat([out[-1][1], codes], 2), scale)
                continue
        out.append((site, codes, scale))
    return out


@pytest.mark.parametrize("seq", [16, 24, 128])
@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize(("bwd", "bwd_reads"), FLAVOURS, ids=["fp8", "bf16", "fp32", "bf16-te", "fp32-te"])
def test_every_code_and_gradient_is_the_untiled_ops(monkeypatch, seq, recipe, bwd, bwd_reads):
    """Q8, K8, V8, P8, O8, dO8, dS8 (and fresh's O8 again), their scales, dQ, dK, dV, the
    saturation and underflow counts and the mechanism's observations, for every policy."""
    linears, core = RECIPES[recipe]
    x = _inputs(seq)
    for policy in POLICIES:
        if policy == "exact" and bwd_reads == "te":
            continue
        runs = []
        for op in (frozen_attention.attention, attention):
            numerics = Numerics(
                make_spec(
                    "fp8",
                    linears,
                    policy,
                    attention=dict(bwd_precision=bwd, bwd_reads=bwd_reads, recipe=core),
                )
            )
            runs.append(_run(op, numerics, x, monkeypatch))
        (old_codes, old), (new_codes, new) = runs
        assert [c[0] for c in old_codes] == [c[0] for c in new_codes], policy
        for (site, a, sa), (_, b, sb) in zip(old_codes, new_codes):
            assert torch.equal(a, b) and torch.equal(sa, sb), (policy, site)
        for i, (a, b) in enumerate(zip(old[:-3], new[:-3])):
            assert torch.equal(a, b), (policy, i)
        assert old[-3:-1] == new[-3:-1], policy
        # the rounded dO's and dS's observations came after the freeze (tests/unit/ops/test_attention_bwd_parts.py)
        assert old[-1] == {k: v for k, v in new[-1].items() if not k.startswith(GRADIENT_OBSERVATIONS)}, policy


@pytest.mark.parametrize("precision", ["bf16", "off"])
def test_the_bf16_baseline_and_rounding_off_are_the_untiled_ops(precision):
    x = _inputs(24, seed=1)
    if precision == "off":
        x = tuple(t.double() for t in x)
    grads = []
    for op in (frozen_attention.attention, attention):
        numerics = Numerics(
            make_spec(precision, policy="exact", attention=dict(bwd_precision="bf16" if precision == "bf16" else "fp8"))
        )
        q, k, v = (t.clone().requires_grad_() for t in x[:3])
        o, _ = op(q, k, v, numerics, NAME)
        o.backward(x[3])
        grads.append((o, q.grad, k.grad, v.grad))
    assert all(torch.equal(a, b) for a, b in zip(*grads))


# ---------------------------------------------------------------------------------------------
# stochastic rounding: draws keyed by position


def _keyed(start: torch.Tensor, rows: int, columns: int, first_row: int = 0) -> torch.Tensor:
    index = torch.arange(first_row, first_row + rows)
    return KeyedDraws(start, index).uniform(torch.empty(rows, columns))


def test_keyed_draws_are_uniform_independent_and_block_free():
    start = torch.tensor([0x1234_5678, 7])
    u = _keyed(start, 512, 512)
    assert torch.equal(u, _keyed(start, 512, 512))  # seeded: the same key and rows, the same draws
    assert torch.equal(u[100:164, :300], _keyed(start, 64, 512, 100)[:, :300])  # a block's own draws
    assert ((u * 2**24) == (u * 2**24).floor()).all() and float(u.min()) >= 0 and float(u.max()) < 1
    counts = torch.histc(u, bins=64, min=0, max=1)
    expected = u.numel() / 64
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 63 + 5 * (2 * 63) ** 0.5  # 63 degrees of freedom, 5 sigma
    centred = u - 0.5
    for a, b in ((centred[:, 1:], centred[:, :-1]), (centred[1:], centred[:-1])):  # neighbours along a row, a column
        assert abs(float((a * b).mean() / centred.var())) < 5 / a.numel() ** 0.5
    other_key, other_rows = torch.tensor([0x1234_5679, 7]), torch.tensor([0x1234_5678, 8])
    assert float((u - _keyed(other_key, 512, 512)).abs().mean()) > 0.3
    assert torch.equal(_keyed(other_rows, 511, 512), u[1:])  # offsets are rows: row i of 8 is row i+1 of 7


def test_stochastic_p_is_unbiased_and_its_draws_do_not_depend_on_the_blocks(monkeypatch):
    """P8 under stochastic rounding: the backward rounds the very codes the forward did (the
    gradients of blocks of 5 rows equal those of one block to FP32 round-off, which they would
    not with other draws), reproducible for a seed, different for another, and unbiased over steps."""
    x = _inputs(24, seed=3)

    def run(seed: int, rows: int, steps: int = 1):
        monkeypatch.setattr(attention_parts, "BLOCK_ELEMENTS", 0)
        monkeypatch.setattr(attention_parts, "MIN_ROWS", rows)
        numerics = Numerics(
            make_spec("fp8", CurrentScaling(), "exact", rounding="stochastic", attention=dict(bwd_precision="fp32")),
            seed=seed,
        )
        out = []
        for _ in range(steps):
            q, k, v = (t.clone().requires_grad_() for t in x[:3])
            with numerics.taping() as tape:
                o, _ = attention(q, k, v, numerics, NAME)
            o.backward(x[3])
            numerics.end_step()
            out.append((tape[0][1], q.grad, k.grad, v.grad))
        return out

    (record, *grads), *_ = run(0, 24)
    (blocked_record, *blocked_grads), *_ = run(0, 5)
    assert torch.equal(record["probs"].data.view(torch.uint8), blocked_record["probs"].data.view(torch.uint8))
    for a, b in zip(grads, blocked_grads):
        assert float((a - b).norm() / a.norm()) < 1e-6
    again = run(0, 24)[0][0]["probs"].data.view(torch.uint8)
    assert torch.equal(record["probs"].data.view(torch.uint8), again)
    assert not torch.equal(record["probs"].data.view(torch.uint8), run(1, 24)[0][0]["probs"].data.view(torch.uint8))
    # unbiased: over steps P8 - P averages to 0 (each step's own P: Q8, K8 are drawn anew too)
    causal = torch.ones(24, 24, dtype=torch.bool).triu(1)
    error = torch.stack(
        [
            r["probs"].dequantize() - torch.softmax(r["scores"].masked_fill(causal, float("-inf")), -1)
            for r, *_ in run(2, 24, 200)
        ]
    )
    noisy = error.std(0) > 0
    z = error.mean(0)[noisy] / (error.std(0)[noisy] / len(error) ** 0.5)
    assert z.abs().max() < 6 and abs(float(z.square().mean()) - 1) < 0.2
    assert not torch.equal(error[0], error[1])  # another step, other draws


def test_the_whole_tensor_rounds_as_its_blocks_do():
    """``quantize`` with keyed draws: a block rounds as the same rows of the whole tensor."""
    x = torch.rand(3, 40, 40)
    start = torch.tensor([99, 0])
    rows = torch.arange(3)[:, None] * 40 + torch.arange(40)
    whole = quantize(x, E4M3, 448.0, "stochastic", KeyedDraws(start, rows))
    block = quantize(x[:, 8:16, :16], E4M3, 448.0, "stochastic", KeyedDraws(start, rows[:, 8:16]))
    assert isinstance(whole, QTensor) and torch.equal(whole.data[:, 8:16, :16].float(), block.data.float())


# ---------------------------------------------------------------------------------------------
# T 4,096


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["exact", "no_saved_copy"])
def test_exact_policies_equal_the_reference_at_t_4096_and_save_no_t_by_t_tensor(policy):
    """At T 4,096 (16 blocks of 256 query rows), with an FP32 backward: dQ, dK, dV equal the
    gradient of the executed forward (``replay``) to FP32 round-off; the saved tensors are
    O(T), none T x T."""
    seq, heads, dim = 4096, 2, 16
    g = torch.Generator().manual_seed(4)
    q0 = torch.randn(1, heads, seq, dim, generator=g) * 2
    k0, v0 = (torch.randn(1, 1, seq, dim, generator=g) for _ in range(2))
    d_out = torch.randn(1, seq, heads * dim, generator=g)
    numerics = Numerics(make_spec("fp8", CurrentScaling(), policy, attention=dict(bwd_precision="fp32")))
    q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
    with numerics.taping() as tape:
        o, _ = attention(q, k, v, numerics, NAME)
    assert len(attention_parts.query_blocks(1, heads, seq)) == 16  # of 256 rows
    saved = o.grad_fn.saved_tensors
    assert max(t.numel() for t in saved) <= seq * heads * dim and sum(t.nbytes for t in saved) < 1 << 20
    o.backward(d_out)
    record = tape[0][1]
    del tape, saved, o
    leaves = [t.clone().requires_grad_() for t in (q0, k0, v0)]
    reference = torch.autograd.grad(replay(*leaves, record, 0.125), leaves, d_out)
    for got, want in zip((q.grad, k.grad, v.grad), reference):
        assert float((got.double() - want.double()).norm() / want.double().norm()) < 1e-5
