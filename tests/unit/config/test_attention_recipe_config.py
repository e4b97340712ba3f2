"""``attention.recipe`` in the config: an FP8 key (refused under precision=bf16 as the
other FP8 keys are), one of null, delayed, current; the rules it changes between keys (an amax
spike needs a history at the sites it matches; a site's margins are bounded in its own format)."""

from __future__ import annotations

import pytest

from readback.backends.convert import _numerics as convert_numerics
from readback.config import validate
from readback.config.entry import exit_on_bad_config
from readback.errors import ConfigError
from toys import compose

SPIKE = "precision.amax_spike={site:attn.core.output,step:1,k:4}"


def _refused(*overrides: str) -> ConfigError:
    with pytest.raises(ConfigError) as error:
        validate(compose(*overrides))
    assert "\n" not in str(error.value)
    return error.value


def test_the_key_is_fp8_only_and_names_its_choices(capsys):
    with pytest.raises(SystemExit) as exit_:
        exit_on_bad_config(["precision=bf16", "attention.recipe=delayed"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip() == (
        "error: attention.recipe='delayed' is not valid; valid: null under precision=bf16 (no FP8 core)"
    )
    with pytest.raises(SystemExit):
        exit_on_bad_config(["attention.recipe=mxfp8"])  # TE's MXFP8 attention: not emulated
    assert (
        "valid: null, delayed, current (no mxfp8: how TE's MXFP8 attention rounds P and dP" in capsys.readouterr().err
    )
    with pytest.raises(ConfigError, match=r"attention\.recipe"):
        convert_numerics("bf16", "exact", "fp8", 0, attention_recipe="delayed")
    assert convert_numerics("fp8", "exact", "fp8", 0, attention_recipe="current").spec.attention_recipe.KEY == "current"


def test_the_old_spelling_is_refused_with_the_new_key(capsys):
    """``precision.attention_recipe`` was the key before it moved to the attention group."""
    with pytest.raises(SystemExit) as exit_:
        exit_on_bad_config(["precision.attention_recipe=delayed"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip() == (
        "error: precision.attention_recipe='delayed' is not a config key any more: it is attention.recipe "
        "(e.g. attention.recipe=delayed)"
    )
    with pytest.raises(ConfigError, match="say attention_recipe='delayed'"):
        convert_numerics({"attention_recipe": "delayed"}, "exact", "fp8", 0)


def test_an_amax_spike_needs_delayed_scaling_at_the_sites_it_matches():
    validate(compose("precision.recipe=current", "attention.recipe=delayed", SPIKE))
    validate(compose("precision.recipe=mxfp8", "attention.recipe=delayed", SPIKE))
    error = _refused("precision.recipe=current", SPIKE)  # no history anywhere
    assert error.key == "precision.amax_spike" and "attention.recipe=delayed" in str(error)
    error = _refused(
        "precision.recipe=current",
        "attention.recipe=delayed",
        "precision.amax_spike={site:mlp.up.input,step:1,k:4}",  # a linear's site: current scaling, no history
    )
    assert error.key == "precision.amax_spike.site" and "sites with an amax history" in str(error)
    error = _refused("attention.recipe=current", SPIKE)  # the core's own recipe has none
    assert error.key == "precision.amax_spike.site" and "attention.recipe=current" in str(error)


def test_a_site_margin_is_bounded_in_the_attention_recipes_format():
    """Under NVFP4 every per-tensor site is E4M3 (its fp8_format), so a margin of 19 rounds the amax
    to zero; the attention recipe there is HYBRID, whose gradients are E5M2 (bound 33)."""
    margin = "precision.site_margin={attn.core.grad_output:20}"
    error = _refused("precision.recipe=nvfp4", margin)
    assert error.key == "precision.site_margin.attn.core.grad_output" and "E4M3 site" in str(error)
    validate(compose("precision.recipe=nvfp4", "attention.recipe=delayed", margin))
    error = _refused(
        "precision.recipe=nvfp4",
        "attention.recipe=delayed",
        "precision.site_margin={attn.core.grad_output:33}",
    )
    assert "E5M2 site layers.0.attn.core.grad_output" in str(error)
