"""The declared gradient sites (``GRADIENT_SITES`` of the ops) are those the ops round in the
recipe's backward format: the config's margin bounds pick each site's format by them."""

import torch

from readback.audit_model.examples import TINY_FOG
from readback.backends import build_model
from readback.model.fog import is_gradient_site, rounding_sites
from toys import config


def test_the_declared_gradient_sites_are_the_ones_rounded_in_the_backward_format():
    cfg = config(*TINY_FOG, "precision.bf16_layers=[]")
    model = build_model(cfg)
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    model(idx, idx).backward()
    sites = model.numerics.sites
    assert sorted(sites) == sorted(rounding_sites(cfg.model.n_layers))
    assert {name for name, site in sites.items() if site.direction == "bwd"} == {
        name for name in sites if is_gradient_site(name)
    }
    assert any(is_gradient_site(name) for name in sites)
