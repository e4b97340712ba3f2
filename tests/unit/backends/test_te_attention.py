"""backend=te with ``attention.recipe``: TE's ``NVTE_DPA_FP8_RECIPE`` (v2.8; under MXFP8
linears v2.15) gives DotProductAttention its own recipe, with its variables pinned from the
precision group; where TE's attention under that recipe reads for D what the policy asks, it runs,
else readback's core runs the same recipe; what TE cannot run is refused in one line."""

from __future__ import annotations

import sys
import types

import pytest

from readback.backends.te import parts as te_backend
from readback.backends.te.facts import Hardware
from readback.backends.te.plan import te_plan
from readback.errors import ConfigError
from toys import config as typed_config

H100 = Hardware((9, 0), (9, 13, 0))
B200 = Hardware((10, 0), (9, 14, 0))
HD128 = ("model.d_model=512", "model.n_heads=4")  # head dim 128
PINNED = {"NVTE_FUSED_ATTN": "1", "NVTE_FLASH_ATTN": "0"}


def config(*overrides: str, experiment: str = "reuse_rounded"):
    return typed_config(
        f"+experiment={experiment}", "backend=te", "data=synthetic", "data.vocab_size=64", *HD128, *overrides
    )


def test_delayed_attention_under_current_linears_runs_on_sm90_with_the_groups_history():
    cfg = config(
        "precision.recipe=current",
        "attention.recipe=delayed",
        "precision.amax_history_len=16",
        "precision.amax_compute_algo=most_recent",
    )
    plan = te_plan(cfg, "2.8.0", H100)  # TE runs the attention's DelayedScaling on sm90
    assert plan.attention_core == "te" and plan.recipe == "Float8CurrentScaling"
    assert plan.recipe_kwargs == dict(fp8_format="HYBRID", fp8_dpa=True, fp8_mha=False)
    assert plan.env == {
        "NVTE_FP8_DPA_BWD": "1",
        "NVTE_DPA_FP8_RECIPE": "DelayedScaling",
        "NVTE_DPA_FP8DS_AMAX_HISTLEN": "16",
        "NVTE_DPA_FP8DS_AMAX_ALGO": "most_recent",
        "NVTE_DPA_FP8DS_REDUCE_AMAX": "1",
        **PINNED,
    }
    assert plan.sites["attention_core"] == (
        "te.DotProductAttention(fp8_dpa; DelayedScaling by NVTE_DPA_FP8_RECIPE under Float8CurrentScaling; "
        "NVTE_FP8_DPA_BWD=1; D reads O8 (the core's output_fp8))"
    )
    assert plan.sites["attention_core.D"] == "O8 (the core's output_fp8)"
    assert "O rounded twice" in plan.sites["attn_proj"]


def test_current_attention_under_delayed_linears_reads_the_f16_o_for_original():
    plan = te_plan(config("policy=original", "attention.recipe=current"), "2.8.0", B200)
    assert plan.attention_core == "te" and plan.recipe_kwargs["fp8_dpa"] is True
    # S and dP take the linears' DelayedScaling: no NVTE_DPA_FP8DS_* variable is read
    assert plan.env == {
        "NVTE_FP8_DPA_BWD": "1",
        "NVTE_DPA_FP8CS_O_in_F16": "1",
        "NVTE_DPA_FP8_RECIPE": "Float8CurrentScaling",
        **PINNED,
    }
    assert plan.sites["attention_core.D"] == "original O (F16)"
    assert plan.sites["attention_core"].endswith("NVTE_DPA_FP8CS_O_in_F16=1; D reads original O (F16))")
    mxfp8 = te_plan(config("policy=original", "precision.recipe=mxfp8", "attention.recipe=current"), "2.15.0", B200)
    assert mxfp8.env["NVTE_DPA_FP8DS_AMAX_HISTLEN"] == "1"  # S, dP: TE's own DelayedScaling, history 1


@pytest.mark.parametrize("recipe, version", [("nvfp4", "2.8.0"), ("mxfp8", "2.15.0")])
def test_block_linears_get_fp8_attention_through_their_own_switches(recipe, version):
    plan = te_plan(config(f"precision.recipe={recipe}", "attention.recipe=delayed"), version, B200)
    assert plan.attention_core == "te" and plan.recipe_kwargs["fp8_dpa"] is True
    assert plan.env["NVTE_DPA_FP8_RECIPE"] == "DelayedScaling"
    assert plan.env.get("NVTE_DPA_FP8_FORMAT") == ("HYBRID" if recipe == "nvfp4" else None)  # else the linears'


def test_naming_the_linears_own_recipe_plans_as_null():
    for recipe in ("delayed", "current"):
        null = te_plan(config(f"precision.recipe={recipe}"), "2.8.0", B200)
        assert te_plan(config(f"precision.recipe={recipe}", f"attention.recipe={recipe}"), "2.8.0", B200) == null
        assert null.env["NVTE_DPA_FP8_RECIPE"] == ""  # pinned: no variable in the environment switches it
        # current: TE's S and dP take a DelayedScaling from these variables, pinned to the emulation's
        pinned = {"NVTE_DPA_FP8DS_AMAX_HISTLEN": "1", "NVTE_DPA_FP8DS_AMAX_ALGO": "most_recent"}
        assert (pinned.items() <= null.env.items()) == (recipe == "current")
    assert "NVTE_DPA_FP8_RECIPE" not in te_plan(config(), "2.7.0", B200).env  # TE 2.7 does not read it


@pytest.mark.parametrize(
    "overrides",
    [
        ("policy=original", "attention.recipe=delayed"),  # delayed attention reads O8
        ("precision.recipe=current", "policy=fresh_reround", "attention.recipe=delayed"),
        ("precision.recipe=mxfp8", "attention.recipe=current", "attention.bwd_precision=bf16"),
    ],
)
def test_a_d_read_te_has_no_switch_for_runs_on_readbacks_core_under_the_same_recipe(overrides):
    plan = te_plan(config(*overrides), "2.15.0", B200)
    assert plan.attention_core == "readback" and plan.env == {}
    core = plan.sites["attention_core"]
    assert core.startswith("readback.ops.attention") and "(attention.recipe=" in core
    assert plan.recipe_kwargs.get("fp8_dpa", False) is False


def _refusal(*overrides: str, version: str = "2.8.0", hardware: Hardware = B200) -> str:
    with pytest.raises(ConfigError) as error:
        te_plan(config(*overrides), version, hardware)
    message = str(error.value)
    assert "\n" not in message and f"Transformer Engine {version} on {hardware.describe()}" in message
    return message


@pytest.mark.parametrize(
    "overrides, version, hardware, start, reason",
    [
        (
            ("precision.recipe=current", "attention.recipe=delayed"),
            "2.7.0",
            B200,
            "attention.recipe='delayed' is not valid; valid: null, or backend.attention_core=readback",
            "NVTE_DPA_FP8_RECIPE, attention's own recipe under Float8CurrentScaling, needs >= 2.8",
        ),
        (
            ("precision.recipe=mxfp8", "attention.recipe=delayed"),
            "2.14.0",
            B200,
            "attention.recipe='delayed'",
            "under MXFP8BlockScaling, needs >= 2.15",
        ),
        (
            ("precision.recipe=blockwise", "attention.recipe=delayed"),
            "2.20.0",
            B200,
            "attention.recipe='delayed'",
            "no FP8 attention under Float8BlockScaling, which asserts fp8_dpa off",
        ),
        (
            ("policy=original", "attention.recipe=current"),
            "2.8.0",
            H100,
            "attention.recipe='current'",
            "FP8 attention under current scaling needs sm100 or newer",
        ),
        (
            ("precision.recipe=mxfp8", "precision.margin=2", "attention.recipe=delayed"),
            "2.15.0",
            B200,
            "precision.margin=2",
            "the attention's DelayedScaling without a margin",
        ),
        (
            ("precision.recipe=current", "precision.interval=2", "attention.recipe=delayed"),
            "2.8.0",
            B200,
            "precision.interval=2",
            "has no DelayedScaling.interval",
        ),
        (
            ("precision.recipe=current", "attention.recipe=delayed", "backend.fp8_mha=true"),
            "2.8.0",
            B200,
            "backend.fp8_mha=True",
            "of another recipe than the projection's",
        ),
    ],
)
def test_what_te_attention_cannot_run_under_its_own_recipe_is_refused(overrides, version, hardware, start, reason):
    message = _refusal(*overrides, version=version, hardware=hardware)
    assert message.startswith(start) and reason in message


def test_readbacks_core_is_the_way_out_of_every_attention_refusal():
    for recipe in ("blockwise", "mxfp8"):
        cfg = config(f"precision.recipe={recipe}", "attention.recipe=delayed", "backend.attention_core=readback")
        assert te_plan(cfg, "2.14.0", B200).attention_core == "readback"


def test_the_attention_recipes_variables_are_guarded_once_te_is_imported(monkeypatch):
    """TE reads NVTE_DPA_FP8_RECIPE and its variables at import: unset is TE's default (empty,
    the linears' recipe), another value in a process that imported TE is refused."""
    for key in ("NVTE_DPA_FP8_RECIPE", "NVTE_DPA_FP8DS_AMAX_HISTLEN"):  # restored after the test
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    monkeypatch.setitem(sys.modules, "transformer_engine", types.ModuleType("transformer_engine"))
    te_backend.apply_te_env({"NVTE_DPA_FP8_RECIPE": "", "NVTE_DPA_FP8DS_AMAX_HISTLEN": "1"})  # TE's defaults
    with pytest.raises(ConfigError, match="fresh process"):
        te_backend.apply_te_env({"NVTE_DPA_FP8_RECIPE": "DelayedScaling"})
