"""The meter over the attention backward's parts: each named backward is the spec its name says
(the BF16 end is ``bwd_reads=te``'s), a switched part differs from its end in that part alone, and
the interactions and D's 2 x 2 are the per-batch differences they are defined as."""

from __future__ import annotations

import pytest
import torch

from readback.backends import build_model
from readback.bias import Variant, measure_bias, variant_spec
from readback.bias.backward_parts import (
    FORWARD_READS,
    PARTS,
    POLICIES,
    backward,
    backwards,
    part_contrasts,
    part_variants,
)
from readback.cli.bias_options import part_variants_of
from readback.errors import ConfigError
from specs import make_spec

FIELDS = ("bwd_precision", "bwd_qkv", "bwd_probs", "bwd_reads")  # the attention settings a backward sets


def _under(name: str, policy: str = "reuse_rounded"):
    base = make_spec("fp8", None, "reuse_rounded")
    return variant_spec(Variant(name, "", policy=policy, backward=backward(name)), base)


def _rounds(spec) -> tuple[bool, bool, bool]:
    return tuple(spec.attention_rounds(g) for g in ("grad_output", "grad_scores", "grad_output_in_d"))


def test_the_two_ends_are_te_s_fp8_and_bf16_backwards():
    for policy in ("reuse_rounded", "fresh_reround", "original"):
        fp8, bf16 = _under("fp8", policy), _under("bf16", policy)
        te = make_spec("fp8", None, policy, attention=dict(bwd_precision="bf16", bwd_reads="te"))
        assert bf16.reads == te.reads and _rounds(bf16) == _rounds(te) == (False, False, False)
        assert bf16.bwd_gemm_precision == "bf16"
        plain = make_spec("fp8", None, policy)
        assert fp8.reads == plain.reads and _rounds(fp8) == _rounds(plain) == (True, True, True)
        assert fp8.bwd_gemm_precision == "fp8"


@pytest.mark.parametrize("part", [*PARTS, "grad_output_in_d"])
def test_a_switched_part_differs_from_its_end_in_that_part_alone(part):
    for end, sign in (("fp8", "-"), ("bf16", "+")):
        name = f"{end}{sign}{part}"
        if name not in backwards():
            continue
        ends, switched = _under(end), _under(name)
        changed = {f for f in FIELDS if getattr(ends.attention, f) != getattr(switched.attention, f)}
        changed |= {f"rounds.{i}" for i, (a, b) in enumerate(zip(_rounds(ends), _rounds(switched))) if a != b}
        changed |= {f"reads.{g}" for g, m in ends.reads["attention"].items() if switched.reads["attention"][g] != m}
        wanted = {
            "qkv": {"bwd_qkv", "reads.dQ", "reads.dK", "reads.dP"},
            "probs": {"bwd_probs", "reads.dV", "reads.dS"},
            "grad_output": {"rounds.0", "rounds.2"},  # D's dO follows the GEMMs' unless set apart
            "grad_scores": {"rounds.1"},
            "gemms": {"bwd_precision"},
            "grad_output_in_d": {"rounds.2"},
        }[part]
        assert changed == wanted, (name, changed)


def test_part_variants_and_names_are_checked():
    names = [v.name for v in part_variants(["fp8-gemms"])]
    policies = ("reuse_rounded", "fresh_reround", "no_saved_copy")
    assert names == [f"{p}@{b}" for b in ("fp8", "bf16", "fp8-gemms") for p in policies]
    every = [v.name for v in part_variants()]
    assert "original@fp8" in every and "original@fp8-grad_output_in_d" in every and len(every) == 3 * 13 + 2
    with pytest.raises(ValueError, match="no backward 'fp8\\+qkv'"):
        backward("fp8+qkv")
    with pytest.raises(ConfigError, match=r"--parts.*fp8-dO.*is not valid"):
        part_variants_of("fp8-dO,fp8-qkv")


def test_the_contrasts_are_the_differences_they_are_defined_as():
    g = torch.Generator().manual_seed(0)
    errors = {v.name: [{"w": torch.randn(3, generator=g)} for _ in range(2)] for v in part_variants()}
    out = part_contrasts(errors)

    def e(name, b=0):
        return errors[name][b]["w"]

    for b in range(2):
        effect = {n: e(f"reuse_rounded@{n}", b) - e(f"fresh_reround@{n}", b) for n in backwards()}
        cost = {n: e(f"reuse_rounded@{n}", b) - e(f"no_saved_copy@{n}", b) for n in backwards()}
        assert torch.equal(out["reuse_vs_fresh@bf16"][b]["w"], effect["bf16"])
        assert torch.equal(out["reuse_vs_control@fp8-probs"][b]["w"], cost["fp8-probs"])
        assert torch.equal(out["interaction.fp8-qkv"][b]["w"], effect["fp8"] - effect["fp8-qkv"])
        assert torch.equal(out["interaction.bf16+gemms"][b]["w"], effect["bf16+gemms"] - effect["bf16"])
        assert torch.equal(out["interaction_vs_control.fp8-grad_scores"][b]["w"], cost["fp8"] - cost["fp8-grad_scores"])
        cells = {n: e(f"reuse_rounded@{n}", b) - e(f"original@{n}", b) for n in ("fp8", "fp8-grad_output_in_d")}
        assert torch.equal(out["d_2x2"][b]["w"], cells["fp8"] - cells["fp8-grad_output_in_d"])
    assert "interaction.fp8" not in out and "interaction.bf16" not in out


def test_the_forward_reads_backward_is_bwd_reads_forward_in_bf16_and_te_reads_its_difference():
    """``bf16+qkv+probs``: TE's BF16 backward with both of its own reads put back, which is the BF16
    backward over the forward's Q8, K8, V8 and P8 that ``attention.bwd_reads=forward`` runs."""
    for policy in ("reuse_rounded", "no_saved_copy", "original"):
        ours = _under(FORWARD_READS, policy)
        forward = make_spec("fp8", None, policy, attention=dict(bwd_precision="bf16", bwd_reads="forward"))
        assert ours.reads == forward.reads and _rounds(ours) == _rounds(forward) == (False, False, False)
        assert ours.bwd_gemm_precision == "bf16" and (ours.attention.bwd_qkv, ours.attention.bwd_probs) == (
            "forward",
            "forward",
        )
    assert FORWARD_READS not in backwards()  # on request only: the parts ladder's default set is unchanged
    names = [v.name for v in part_variants_of(f"bf16,{FORWARD_READS}")]
    assert names == [f"{p}@{b}" for b in ("fp8", "bf16", FORWARD_READS) for p in POLICIES]
    g = torch.Generator().manual_seed(2)
    errors = {n: [{"w": torch.randn(3, generator=g)}] for n in names}
    out = part_contrasts(errors)
    for p in POLICIES:
        assert torch.equal(
            out[f"te_reads@{p}"][0]["w"], errors[f"{p}@bf16"][0]["w"] - errors[f"{p}@{FORWARD_READS}"][0]["w"]
        )
    assert "te_reads@reuse_rounded" not in part_contrasts({n: v for n, v in errors.items() if FORWARD_READS not in n})


def test_the_meter_runs_the_parts_on_a_model(tiny_cfg):
    """Every variant's forward is the executed one (the meter checks it); dS's rounding, switched
    off from the FP8 end, moves the reuse effect; no contrast is NaN with 4 batches."""
    torch.manual_seed(0)
    model = build_model(tiny_cfg("policy=reuse_rounded"))
    g = torch.Generator().manual_seed(1)
    batches = [tuple(torch.randint(0, 64, (2, 16), generator=g) for _ in range(2)) for _ in range(4)]
    result = measure_bias(model, batches, part_variants(["fp8-grad_scores"]), contrasts=part_contrasts)
    stats = result.stats
    assert set(stats) >= {"reuse_vs_fresh@fp8", "reuse_vs_control@fp8-grad_scores", "interaction.fp8-grad_scores"}
    assert stats["interaction.fp8-grad_scores"]["total"]["rel_err"] > 0
    assert all(v == v for v in stats["interaction.fp8-grad_scores"]["total"].values())
