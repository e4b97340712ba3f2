"""scripts/recipe_meters.py: each recipe it meters is a valid config of its own, and the table
reads the meter's figures where they are (the configured policy's, each read's contribution)."""

from __future__ import annotations

import pytest

from recipe_meters import GROUPS, READS, RECIPES, markdown, table
from toys import config


@pytest.mark.parametrize("name", RECIPES)
def test_each_recipe_is_a_config_the_meter_can_build(name):
    keys = [f"precision.{k}" for k in RECIPES[name]]
    p = config("+experiment=reuse_rounded", "precision.fp8_format=null", *keys).precision
    assert RECIPES[name][0].removeprefix("recipe=") == p.scaling_recipe().KEY


def _figures(scale: float) -> dict:
    return {
        g: {
            "rel_err": scale,
            "bias": scale / 2,
            "bias_se": scale / 4,
            "floor": scale / 4,
            "debiased_sq": scale**2,
            "debiased_sq_se": scale**2 / 3,
            "projection": -scale,
            "projection_se": scale / 5,
        }
        for g in GROUPS
    }


def test_the_table_takes_the_configured_policy_and_each_read_present():
    bias = {
        "policy": "reuse_rounded",
        "batches": 8,
        "variants": ["reuse_rounded", READS[0]],
        "stats": {"reuse_rounded": _figures(0.1), "exact": _figures(9.0), READS[0]: _figures(0.02)},
    }
    rows = table({"nvfp4": bias})
    assert rows["nvfp4"]["total"]["rel_err"] == 0.1  # the configured backward, not another variant
    assert rows["nvfp4"][f"{READS[0]}/total"]["projection"] == -0.02
    assert not any(k.startswith(READS[1]) for k in rows["nvfp4"])  # a read the recipe does not change
    text = markdown(rows)
    assert "| nvfp4 | 0.1000 | 0.0500 / 0.0250 | +1.00e-02 ± 3.33e-03 |" in text
    assert "| nvfp4 | exact_read.linear.wgrad | total | +4.00e-04 ± 1.33e-04 | -0.0200 ± 0.0040 |" in text
