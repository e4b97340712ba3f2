"""The attention backward's parts set apart one at a time (``attention.bwd_qkv``, ``bwd_probs``,
``round_grad_output``, ``round_grad_scores``, with ``bwd_precision`` the GEMMs'): each changes
exactly the reads or roundings it names, and the parts put together are the two named ends, TE's
FP8 backward and its BF16 one (``bwd_reads=te``), bit for bit."""

from __future__ import annotations

import pytest
import torch

from readback.errors import ConfigError
from readback.numerics import E5M2, DelayedScaling, quantize
from readback.numerics.attention_settings import AttentionSettings
from readback.numerics.precision_settings import Fp8Settings, PrecisionSettings
from readback.numerics.settings import NumericsSettings
from readback.numerics.state import Numerics
from readback.ops import attention_parts
from readback.ops.attention import P_READERS, QKV_READERS, attention
from readback.ops.mechanism import GradientRounding
from specs import make_spec

C = 0.125
B, H, G, T, HD = 2, 4, 2, 40, 16
FP8_END = dict(bwd_precision="fp8", bwd_reads="forward")
BF16_END = dict(bwd_precision="bf16", bwd_reads="te")
# the BF16 end said part by part, its flavour left at forward
BF16_PARTS = dict(
    bwd_precision="bf16",
    bwd_qkv="original",
    bwd_probs="rebuilt",
    round_grad_output=False,
    round_grad_scores=False,
)


def _inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "q": torch.randn(B, H, T, HD, generator=g) * 2,
        "k": torch.randn(B, G, T, HD, generator=g) * 2,
        "v": torch.randn(B, G, T, HD, generator=g),
        "d_o": torch.randn(B, T, H * HD, generator=g) * 1e-3,
    }


def _run(policy: str = "reuse_rounded", **backward):
    """(dQ, dK, dV) of two steps of the op under DelayedScaling (the second with a history), and
    the sites the backward rounded at."""
    numerics = Numerics(make_spec("fp8", DelayedScaling(amax_history_len=4), policy, attention=backward), seed=1)
    x = _inputs()
    for _ in range(2):
        q, k, v = (x[n].clone().requires_grad_() for n in ("q", "k", "v"))
        o, _ = attention(q, k, v, numerics, "attn.core", C)
        o.backward(x["d_o"])
        numerics.end_step()
    return (q.grad, k.grad, v.grad), set(numerics.sites)


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("policy", ["reuse_rounded", "no_saved_copy"])
def test_the_parts_put_together_are_the_two_named_ends_bit_for_bit(policy):
    fp8_parts = dict(
        bwd_qkv="forward",
        bwd_probs="forward",
        round_grad_output=True,
        round_grad_scores=True,
    )
    assert _same(_run(policy, **FP8_END)[0], _run(policy, **FP8_END, **fp8_parts)[0])
    assert _same(_run(policy, **BF16_END)[0], _run(policy, **BF16_PARTS)[0])
    assert not _same(_run(policy, **FP8_END)[0], _run(policy, **BF16_END)[0])


@pytest.mark.parametrize(
    ("part", "mode", "gradients"), [("qkv", "original", QKV_READERS), ("probs", "rebuilt", P_READERS)]
)
def test_a_read_part_changes_exactly_its_gradients_reads_from_either_end(part, mode, gradients):
    fp8 = make_spec("fp8", None, "reuse_rounded", attention=FP8_END).reads["attention"]
    bf16 = make_spec("fp8", None, "reuse_rounded", attention=BF16_END).reads["attention"]
    for end, back, wanted in ((FP8_END, mode, dict.fromkeys(gradients, mode)), (BF16_END, "forward", fp8)):
        plain = make_spec("fp8", None, "reuse_rounded", attention=end).reads["attention"]
        switched = make_spec("fp8", None, "reuse_rounded", attention={**end, f"bwd_{part}": back})
        changed = {g: m for g, m in switched.reads["attention"].items() if m != plain[g]}
        assert changed == {g: wanted[g] for g in gradients}, (end, changed)
    assert {g for g in fp8 if fp8[g] != bf16[g]} == {*QKV_READERS, *P_READERS}  # the two parts are all of it


def test_a_rounding_part_rounds_exactly_its_gradient():
    fp8_grads, fp8_sites = _run(**FP8_END)
    assert {"attn.core.grad_output", "attn.core.grad_scores"} <= fp8_sites
    for gradient in ("grad_output", "grad_scores"):
        other = ({"grad_output", "grad_scores"} - {gradient}).pop()
        grads, sites = _run(**FP8_END, **{f"round_{gradient}": False})
        assert f"attn.core.{gradient}" not in sites and f"attn.core.{other}" in sites
        assert not _same(grads, fp8_grads)
        _, sites = _run(**BF16_END, **{f"round_{gradient}": True})  # put back into the BF16 end
        assert f"attn.core.{gradient}" in sites and f"attn.core.{other}" not in sites
    assert not {"attn.core.grad_output", "attn.core.grad_scores"} & _run(**BF16_END)[1]


def test_the_gemms_alone_keep_the_fp8_roundings():
    """bwd_precision=bf16 with dO and dS still rounded to E5M2 and the FP8 forward's reads: only the
    GEMMs leave FP8 (E5M2 and E4M3 values are BF16 values: the BF16 GEMM multiplies the same)."""
    both = dict(round_grad_output=True, round_grad_scores=True)
    grads, sites = _run(bwd_precision="bf16", **both)
    assert {"attn.core.grad_output", "attn.core.grad_scores"} <= sites
    assert not _same(grads, _run(**FP8_END)[0]) and not _same(grads, _run(bwd_precision="bf16")[0])


def test_an_fp8_gemm_of_an_operand_that_is_no_code_runs_in_fp32():
    """The FP8 backward with the original Q, K, V: the GEMMs that read them multiply values."""
    grads, _ = _run(**FP8_END, bwd_qkv="original")
    assert all(torch.isfinite(g).all() for g in grads) and not _same(grads, _run(**FP8_END)[0])


def test_the_config_refuses_parts_without_an_fp8_forward_or_under_exact():
    with pytest.raises(ConfigError, match=r"attention\.bwd_qkv='original'.*precision=bf16"):
        NumericsSettings(
            PrecisionSettings(name="bf16"),
            AttentionSettings(bwd_precision="fp8", bwd_reads="forward", bwd_qkv="original"),
            "reuse_rounded",
        ).check()
    with pytest.raises(ConfigError, match=r"attention\.round_grad_output=False.*policy=exact"):
        NumericsSettings(
            Fp8Settings(name="fp8"),
            AttentionSettings(bwd_precision="fp8", bwd_reads="forward", round_grad_output=False),
            "exact",
        ).check()
    with pytest.raises(ConfigError, match=r"attention\.bwd_probs"):
        AttentionSettings(bwd_precision="fp8", bwd_reads="forward", bwd_probs="p8")


def test_what_rounding_a_gradient_loses_is_counted_as_it_is_defined():
    """E5M2 at scale 1: 2^-18 rounds to zero (below half the smallest subnormal, 2^-16), 3 x 2^-16
    to a subnormal, 1 and 4 stay normal; the zero is no nonzero element but counts in the rms."""
    x = torch.tensor([0.0, 2.0**-18, 3 * 2.0**-16, 1.0, 4.0])
    loss = GradientRounding("attn.core.grad_scores")
    for half in (x[:2], x[2:]):  # added block by block, as the backward adds dS
        loss.add(half, quantize(half, E5M2, torch.tensor(1.0)))
    numerics = Numerics(make_spec("fp8"))
    loss.observe(numerics)
    stats = numerics.pop_observations()
    assert stats["attn_grad_flushed/mean/attn.core.grad_scores"] == 0.25
    assert stats["attn_grad_subnormal/mean/attn.core.grad_scores"] == 0.25
    rms = float(x.double().square().mean().sqrt())
    assert stats["attn_grad_amax_to_rms/mean/attn.core.grad_scores"] == pytest.approx(4.0 / rms, rel=1e-12)


def test_the_backward_logs_what_rounding_do_and_ds_loses_on_mechanism_steps():
    numerics = Numerics(make_spec("fp8", None, "reuse_rounded"), seed=1)
    x = _inputs()
    q, k, v = (x[n].clone().requires_grad_() for n in ("q", "k", "v"))
    with numerics.measuring():
        o, _ = attention(q, k, v, numerics, "attn.core", C)
        o.backward(x["d_o"])
    stats = numerics.pop_observations()
    for gradient in ("grad_output", "grad_scores"):
        for kind in ("attn_grad_flushed", "attn_grad_subnormal", "attn_grad_amax_to_rms"):
            assert 0 <= stats[f"{kind}/mean/attn.core.{gradient}"] < float("inf")
    assert stats["attn_grad_amax_to_rms/mean/attn.core.grad_scores"] > 1


@pytest.mark.parametrize("end", [FP8_END, BF16_END], ids=["fp8", "bf16"])
def test_the_do_that_d_reads_is_a_part_of_its_own(monkeypatch, end):
    """``round_grad_output_in_d``: D's dO apart from the GEMMs' (D's inputs as {O8, O} x {dO8, dO}).
    Its default is the GEMMs' dO; set the other way it moves dQ and dK but not dV, which reads no
    D; and with D held at zero it moves nothing: it acts through D alone."""
    follows = end is FP8_END  # the FP8 end rounds the dO that its GEMMs and D read
    grads, _ = _run(**end)
    assert _same(grads, _run(**end, round_grad_output_in_d=follows)[0])
    other, sites = _run(**end, round_grad_output_in_d=not follows)
    assert torch.equal(other[2], grads[2]) and not torch.equal(other[0], grads[0])
    assert not torch.equal(other[1], grads[1])
    assert "attn.core.grad_output" in sites  # rounded for the GEMMs, or for D alone
    monkeypatch.setattr(attention_parts, "o_rows", lambda numerics, o, rows, heads: torch.zeros(()))
    assert _same(_run(**end)[0], _run(**end, round_grad_output_in_d=not follows)[0])


def test_the_config_refuses_a_d_read_of_do_where_d_reads_no_o():
    NumericsSettings(
        Fp8Settings(name="fp8"),
        AttentionSettings(bwd_precision="fp8", bwd_reads="forward", round_grad_output_in_d=False),
        "reuse_rounded",
    ).check()
    with pytest.raises(ConfigError, match=r"attention\.round_grad_output_in_d=False.*policy=no_saved_copy"):
        NumericsSettings(
            Fp8Settings(name="fp8"),
            AttentionSettings(bwd_precision="fp8", bwd_reads="forward", round_grad_output_in_d=False),
            "no_saved_copy",
        ).check()
