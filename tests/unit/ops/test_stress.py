"""Scale stress and underflow: ``precision.site_margin`` divides the scale of the matched sites
only, exactly as the recipe's margin would, at every read of the site; ``underflow_fractions``
counts nonzero elements that rounded to zero or to a subnormal."""

from __future__ import annotations

import pytest
import torch

from readback.backends import build_model
from readback.errors import ConfigError
from readback.model import rounding_sites
from readback.numerics import E4M3, E5M2, CurrentScaling, compute_scale
from readback.numerics.site import Site
from readback.numerics.state import Numerics
from readback.ops.attention import attention
from readback.ops.linear import linear
from specs import make_spec
from toys import config


def _compose(*overrides):
    return config("data=synthetic", "data.vocab_size=64", "model.vocab_size=64", *overrides)


def test_site_margin_is_the_recipe_margin_at_matched_sites_only():
    x = torch.randn(64, 32)
    stressed = Numerics(make_spec(recipe=CurrentScaling(), site_margin={"attn.core.output": 5}))
    te_margin = Numerics(make_spec(recipe=CurrentScaling(margin=5)))
    matched = stressed.site("layers.1.attn.core.output").quantize(x)
    assert torch.equal(matched.scale, compute_scale(x.abs().amax(), E4M3, margin=5))
    assert torch.equal(matched.data.float(), te_margin.site("any").quantize(x).data.float())
    other = stressed.site("layers.1.attn.core.q").quantize(x)
    assert torch.equal(other.scale, compute_scale(x.abs().amax(), E4M3, margin=0))


@pytest.mark.parametrize("policy", ["reuse_rounded", "fresh_reround"])
def test_site_margin_reaches_every_read_of_the_site(policy, monkeypatch):
    """The forward's O8 (which the projection multiplies and reuse reads) and fresh's
    re-rounding grid all carry the stressed scale."""
    produced = []
    quantize = Site.quantize

    def spy(self, x, *args, **kwargs):
        q = quantize(self, x, *args, **kwargs)
        produced.append((self.name, kwargs.get("stream", "forward"), q.scale.clone(), x.abs().amax()))
        return q

    monkeypatch.setattr(Site, "quantize", spy)
    numerics = Numerics(make_spec(recipe=CurrentScaling(), policy=policy, site_margin={"core.output": 7}))
    q, k, v = (torch.randn(2, h, 16, 16, requires_grad=True) for h in (4, 2, 2))
    w = torch.randn(32, 64, requires_grad=True)
    o, oq = attention(q, k, v, numerics, "layers.0.attn.core")
    linear(o, w, numerics, "layers.0.attn.proj", x_q=oq).square().sum().backward()
    reads = [(stream, scale, amax) for name, stream, scale, amax in produced if name == "layers.0.attn.core.output"]
    assert [s for s, _, _ in reads] == (["forward"] if policy == "reuse_rounded" else ["forward", "fresh"])
    forward_amax = reads[0][2]
    for _, scale, _ in reads:
        assert torch.equal(scale, compute_scale(forward_amax, E4M3, margin=7))
    assert torch.equal(oq.scale, reads[0][1])
    assert "layers.0.attn.proj.input" not in numerics.sites  # the projection multiplied that very copy


def test_underflow_counts_zeros_and_subnormals_of_a_hand_made_tensor():
    # E4M3 at scale 1 (amax 448): normals start at 2**-6 = 0.015625, subnormal spacing 2**-9.
    x = torch.tensor([0.0, 448.0, 1.0, 0.01, 0.0005, 0.0156, -0.003, 0.0])
    numerics = Numerics(make_spec(recipe=CurrentScaling()))
    numerics.site("t").quantize(x)
    # nonzero: 6; 0.01 and -0.003 are subnormals, 0.0005 flushes to 0, 0.0156 rounds up to 2**-6.
    assert numerics.underflow_fractions() == {"t": pytest.approx(3 / 6)}
    assert numerics.underflow_fractions() == {}  # reset by the call
    numerics.site("t").quantize(x, scale=torch.tensor(2.0**-10))  # too small for everything but 448
    assert numerics.underflow_fractions()["t"] == pytest.approx(5 / 6)


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=str)
def test_underflow_count_on_codes_matches_the_values(fmt):
    """The count taken on the codes' exponent bits is the count of nonzero elements whose
    rounded value is below the smallest normal, for both formats, NaN and zeros included."""
    x = torch.cat([torch.randn(20_000) * torch.logspace(-12, 1, 20_000), torch.tensor([0.0, -0.0, float("nan")])])
    numerics = Numerics(make_spec(recipe=CurrentScaling(fp8_format="e4m3" if fmt is E4M3 else "hybrid")))
    site = numerics.site("t", "fwd" if fmt is E4M3 else "bwd")
    q = site.quantize(x)
    nonzero = x != 0
    small = q.data.float().abs() < 2.0**fmt.min_exponent
    assert site.underflowed.item() == (small & nonzero).sum().item() > 0
    assert site.nonzero.item() == nonzero.sum().item()


def test_site_margin_pushes_the_output_into_underflow():
    x = torch.randn(4096)
    plain, stressed = (
        Numerics(make_spec(recipe=CurrentScaling())),
        Numerics(make_spec(recipe=CurrentScaling(), site_margin={"o": 14})),
    )
    plain.site("o").quantize(x), stressed.site("o").quantize(x)
    assert plain.underflow_fractions()["o"] < 0.01 < 0.9 < stressed.underflow_fractions()["o"]


def test_rounding_sites_are_the_sites_one_step_creates():
    cfg = _compose("model.n_layers=2", "precision.bf16_layers=[]")
    model = build_model(cfg)
    idx = torch.randint(0, 64, (2, cfg.model.seq_len))
    model(idx, idx).backward()
    assert sorted(rounding_sites(model.cfg.n_layers)) == sorted(model.numerics.sites)


def test_site_margin_config():
    cfg = _compose("precision.site_margin={attn.core.output:14}")  # the typed config: checked
    numerics = build_model(cfg).numerics
    assert numerics.site("layers.0.attn.core.output").margin == 14
    assert numerics.site("layers.0.attn.core.q").margin == 0
    for override, key in (
        ("precision.site_margin={attn.kore.output:14}", "precision.site_margin"),
        ("precision.site_margin={attn.core.output:-1}", "precision.site_margin.attn.core.output"),
    ):
        with pytest.raises(ConfigError) as error:
            _compose(override)
        assert error.value.key == key and "valid:" in str(error.value)
