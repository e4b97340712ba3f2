"""The bias meter: its zero is the reference, it finds a planted wrong read, it separates the
D-term read from the backward's gradient roundings, and it leaves the run as it was."""

from __future__ import annotations

import torch

from readback.backends import build_model
from readback.bias import measure_bias, variants
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
