"""The bias meter: its zero is the reference, it finds a planted wrong read, it separates the
D-term read from the backward's gradient roundings, it reads O's rounding in its own forwards,
and it leaves the run as it was."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from readback.backends import build_model
from readback.bias import measure_bias, variants
from readback.probe import taped_backward
from toys import planted_spec


def _model(tiny_cfg, *overrides):
    cfg = tiny_cfg("precision.recipe=current", *overrides)
    torch.manual_seed(0)
    return build_model(cfg)


def _batches(n=2):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 64, (2, 16), generator=g), torch.randint(0, 64, (2, 16), generator=g)) for _ in range(n)]


def test_everything_exact_is_the_reference_and_the_run_is_untouched(tiny_cfg):
    model = _model(tiny_cfg, "policy=reuse_rounded")
    before = model.numerics.state_dict()
    result = measure_bias(model, _batches())
    assert result.stats["all_exact"]["total"]["rel_err"] < 1e-6
    assert result.stats["reuse_rounded"]["total"]["rel_err"] > 1e-3  # FP8 backward: a visible error
    assert all(p.grad is None for p in model.parameters())
    after = model.numerics.state_dict()
    assert after["step"] == before["step"] and set(after["sites"]) == set(before["sites"])
    assert result.steps_per_batch > 1 and set(result.metrics()) >= {
        "grad_bias/reuse_rounded/total",
        "grad_bias_cos/all_exact/total",
    }


def test_a_planted_wrong_read_is_found_where_it_acts(tiny_cfg):
    """A test-only policy whose softmax backward reads the FP8 copy P8 instead of the original
    P: the meter lists that read, and switching it back to exact moves the gradients of the
    attention inputs (QKV and everything before it), never the projection or MLP after it."""
    model = _model(tiny_cfg, "policy=exact")
    numerics = model.numerics
    planted = planted_spec(numerics.spec)
    with numerics.using(planted):
        names = [v.name for v in variants(numerics)]
        assert "exact_read.attention.dS" in names and "planted" in names
        result = measure_bias(model, _batches())
    assert numerics.spec.reads["attention"]["dS"] == "original" and result.policy == "planted"
    contribution = result.stats["contrib.exact_read.attention.dS"]
    for group in ("layers.1.attn.qkv", "layers.0.attn.qkv", "layers.0.mlp.up", "embedding"):
        assert contribution[group]["rel_err"] > 1e-3, group
    for group in ("layers.1.attn.proj", "layers.1.attn_norm", "layers.1.mlp.up", "layers.1.mlp.act"):
        assert contribution[group]["rel_err"] == 0.0, group
    assert "contrib.planted" not in result.stats  # the configured backward is no contribution of its own


def test_the_d_term_read_is_its_own_contribution(tiny_cfg):
    """Under a stressed reuse_rounded the D-term read moves the attention inputs' gradients of its
    layer (and everything before), never the projection or MLP after it; the attention
    backward's E5M2 roundings are a separate entry."""
    model = _model(tiny_cfg, "policy=reuse_rounded", "precision.site_margin={attn.core.output:10}")
    result = measure_bias(model, _batches())
    d_term = result.stats["contrib.exact_read.attention.D"]
    assert d_term["layers.1.attn.qkv"]["rel_err"] > 1e-3
    for group in ("layers.1.attn.proj", "layers.1.mlp.up", "layers.1.mlp.down", "layers.1.attn_norm"):
        assert d_term[group]["rel_err"] == 0.0, group
    assert result.stats["contrib.fresh_reround"]["layers.1.attn.qkv"]["rel_err"] > 0
    assert result.stats["contrib.no_saved_copy"]["total"]["rel_err"] == 0.0  # no_saved_copy reads like exact
    assert "contrib.exact_bwd.attention" in result.stats


def test_o_rounding_is_read_in_the_meters_own_forward_and_the_counters_stay(tiny_cfg):
    """O's underflow as the meter reports it is the run's own counter over the same executed
    forward (one batch, its stream salt); the run's counters after the meter are those before;
    a larger margin (the study's stress, 2**-14) rounds more of O away."""
    stressed = ("policy=reuse_rounded", "precision.site_margin={attn.core.output:14}")
    model = _model(tiny_cfg, *stressed)
    (x, y), *_ = batches = _batches(3)
    taped_backward(model, x, y)  # a training step's counts, pending in the run
    expected_fractions = copy.deepcopy(model).numerics.underflow_fractions()
    result = measure_bias(model, batches[:1])
    assert expected_fractions["layers.0.attn.core.output"] > 0  # counts to keep
    assert model.numerics.underflow_fractions() == expected_fractions

    twin = _model(tiny_cfg, *stressed)
    with twin.numerics.isolated("/bias0"):
        taped_backward(twin, x, y)  # the meter's executed forward (reuse_rounded reads O8, no new rounding of O)
        counted = twin.numerics.underflow_fractions()
    o = result.o_rounding
    assert set(o) == {"layers.0.attn", "layers.1.attn"} and result.site_margin == {"attn.core.output": 14}
    for layer, stats in o.items():
        assert stats["underflow"] == pytest.approx(counted[f"{layer}.core.output"], rel=1e-12)
        assert stats["margin"] == 14 and 0 < stats["rel_err"] < 1 and stats["amax_to_rms"] > 1
    calm = measure_bias(_model(tiny_cfg, "policy=reuse_rounded"), batches[:1]).o_rounding
    for layer in o:
        assert calm[layer]["underflow"] < o[layer]["underflow"] and calm[layer]["rel_err"] < o[layer]["rel_err"]
        assert calm[layer]["margin"] == 0


def test_o_rounding_gives_the_history_amax_under_delayed_scaling(tiny_cfg):
    """The meter's ``history_amax_to_rms`` is the training log's figure (one definition): the amax
    O8's delayed scale came from, over O's rms; at margin 0 it places O on the grid as
    ``log2_rms_scaled`` does. Current scaling has no history, and no such figure."""
    torch.manual_seed(0)
    model = build_model(tiny_cfg("policy=reuse_rounded"))  # delayed scaling, margin 0
    (x, y), *_ = batches = _batches(1)
    taped_backward(model, x, y)
    model.numerics.end_step()  # a history entry: the scale comes from it
    measured = measure_bias(model, batches).o_rounding
    assert set(measured) == {"layers.0.attn", "layers.1.attn"}
    for o in measured.values():
        assert o["history_amax_to_rms"] > 1
        assert o["log2_rms_scaled"] == pytest.approx(math.log2(448) - math.log2(o["history_amax_to_rms"]), abs=1e-6)
    current = measure_bias(_model(tiny_cfg, "policy=reuse_rounded"), batches).o_rounding
    assert all("history_amax_to_rms" not in o for o in current.values())


def test_the_new_statistics_reach_training_and_the_json(tiny_cfg):
    result = measure_bias(_model(tiny_cfg, "policy=reuse_rounded"), _batches(4))
    metrics, stats = result.metrics(), result.stats["contrib.exact_read.attention.D"]["total"]
    for stat, key in (("projection", "projection"), ("projection_se", "projection_se"), ("debiased_sq", "debiased_sq")):
        assert metrics[f"grad_bias_{key}/contrib.exact_read.attention.D/total"] == stats[stat]
    assert (
        metrics["grad_bias_debiased_sq_se/reuse_rounded/total"]
        == result.stats["reuse_rounded"]["total"]["debiased_sq_se"]
    )
    assert stats["floor"] == stats["bias_se"] > 0
    assert result.to_json()["o_rounding"] == result.o_rounding


def test_the_backward_gemms_accumulation_is_attributed_per_gemm_kind(tiny_cfg):
    """Under hopper accumulation the meter switches dgrad and wgrad to IEEE FP32 one at a time:
    the forward stays the executed one (the meter checks the loss bit for bit), each switch
    moves the gradients it feeds, and each linear's K is read from the tape."""
    model = _model(tiny_cfg, "policy=reuse_rounded", "precision.accumulation=hopper")
    names = [v.name for v in variants(model.numerics)]
    assert {"ieee_acc.dgrad", "ieee_acc.wgrad"} <= set(names)
    result = measure_bias(model, _batches())
    wgrad, dgrad = result.stats["contrib.ieee_acc.wgrad"], result.stats["contrib.ieee_acc.dgrad"]
    assert wgrad["layers.1.mlp.down"]["rel_err"] > 0  # a wgrad GEMM's own sums
    assert dgrad["layers.1.mlp.down"]["rel_err"] == 0  # its weight's gradient has no dgrad upstream of it
    assert dgrad["layers.0.attn.qkv"]["rel_err"] > 0  # the dgrads of every later linear feed it
    out_features, in_features = dict(model.named_parameters())["layers.0.attn.qkv.weight"].shape
    assert result.gemm_k["layers.0.attn.qkv"] == {"fprop": in_features, "dgrad": out_features, "wgrad": 2 * 16}
    assert "lm_head" not in result.gemm_k  # kept in BF16: no FP8 accumulation
    assert result.to_json()["gemm_k"] == result.gemm_k


def test_ieee_and_native_accumulation_on_the_cpu_add_no_accumulation_variant(tiny_cfg):
    for accumulation in ("ieee", "native"):
        model = _model(tiny_cfg, "policy=reuse_rounded", f"precision.accumulation={accumulation}")
        assert not [v for v in variants(model.numerics) if v.accumulation]
