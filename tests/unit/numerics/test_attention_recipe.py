"""``attention.recipe``: the attention core's own per-tensor recipe (TE's
``NVTE_DPA_FP8_RECIPE``). Its sites, and only its, take it, by their names; null is the linears'
recipe, as before the key existed (per tensor from the tensor's own amax under a block recipe)."""

from __future__ import annotations

import pickle

import pytest
import torch

from readback.backends import build_model
from readback.errors import ConfigError
from readback.numerics import (
    E4M3,
    E5M2,
    CurrentScaling,
    CurrentScalingState,
    DelayedScaling,
    DelayedScalingState,
    Format,
    MXFP8BlockScaling,
    ScalingRecipe,
)
from readback.numerics.attention_settings import AttentionSettings
from readback.numerics.precision_settings import fp8_settings_of
from readback.numerics.settings import NumericsSettings
from readback.numerics.spec import is_attention_site
from readback.numerics.state import Numerics
from readback.ops import numerics_spec
from readback.ops.attention import attention
from readback.ops.linear import linear
from specs import make_spec
from toys import config, train_on_one_batch

TINY = (
    "data=synthetic",
    "data.vocab_size=128",
    "model.vocab_size=128",
    "model.seq_len=32",
    "model.d_model=32",
    "model.n_heads=2",
    "model.n_kv_groups=1",
    "model.ffn_dim=64",
    "model.n_layers=1",
)
CORE = "layers.0.attn.core"


def _trained(*overrides: str, steps: int = 2):
    """``(losses, model)`` after ``steps`` optimizer steps of the tiny FOG on one fixed batch."""
    torch.manual_seed(0)
    model = build_model(config("+experiment=reuse_rounded", *TINY, *overrides))
    return train_on_one_batch(model, torch.randint(0, 128, (2, 32)), steps), model


def _states(model) -> dict[str, tuple]:
    """``{site kind: (its scaling state's class, format, margin, history length)}`` (kinds:
    ``attn.core.q``, ``mlp.up.input``, ...)."""
    return {
        name.split(".", 2)[-1]: (
            type(site.state).__name__,
            site.fmt.name if site.fmt else None,
            getattr(getattr(site.state, "recipe", None), "margin", None),
            len(site.state.history) if isinstance(site.state, DelayedScalingState) else None,
        )
        for name, site in model.numerics.sites.items()
    }


def test_an_attention_site_is_known_by_its_name():
    for name in (f"{CORE}.q", f"{CORE}.grad_scores", "model.layers.0.self_attn.core.output", "core.v"):
        assert is_attention_site(name), name
    for name in ("layers.0.attn.proj.grad_output", "layers.0.attn.qkv.input", "attn.q", "layers.0.attn.corex.q"):
        assert not is_attention_site(name), name


CORE_SITES = ("q", "probs", "output", "grad_output", "grad_scores")
CURRENT, DELAYED = "CurrentScalingState", "DelayedScalingState"


@pytest.mark.parametrize(
    "recipe, core_states, linear_state",
    [
        ("delayed", (DELAYED,) * 5, DELAYED),
        ("current", (CURRENT, DELAYED, CURRENT, CURRENT, DELAYED), CURRENT),  # TE's S and dP: delayed
        ("mxfp8", (CURRENT,) * 5, CURRENT),  # the core per tensor, each tensor's own amax
    ],
)
def test_null_is_the_linears_recipe_as_before(recipe, core_states, linear_state):
    """The default keeps every site's state, and naming the linears' own per-tensor recipe trains
    bit for bit as null does: nothing of the recipe's fields is lost or added on the way."""
    null_losses, null = _trained(f"precision.recipe={recipe}", "precision.amax_history_len=4")
    states = _states(null)
    assert tuple(states[f"attn.core.{s}"][0] for s in CORE_SITES) == core_states
    assert {states[s][0] for s in ("attn.qkv.input", "mlp.down.grad_output")} == {linear_state}
    assert null.numerics.spec.attention_recipe is None
    if recipe == "mxfp8":
        return
    losses, model = _trained(f"precision.recipe={recipe}", "precision.amax_history_len=4", f"attention.recipe={recipe}")
    assert losses == null_losses and _states(model) == states
    own = model.numerics.spec.attention_recipe
    assert own is not None and recipe == own.KEY


@pytest.mark.parametrize("linears", ["delayed", "current", "mxfp8", "nvfp4"])
def test_a_current_scaling_core_scales_p_and_ds_by_te_delayed_scaling(linears):
    """TE's current-scaling attention quantises S (P) and dP (dS) with a DelayedScaling: the
    linears' under delayed linears, else one of history 1 and ``most_recent`` in the attention's
    format, without margin. After two steps their scale is the first step's amax's, while Q and
    O are scaled by their own amax."""
    overrides = ("precision.amax_history_len=4", "precision.margin=1") if linears == "delayed" else ()
    _, model = _trained(f"precision.recipe={linears}", "attention.recipe=current", *overrides)
    sites = model.numerics.sites
    linear_recipe = model.numerics.spec.recipe
    fmt = Format.HYBRID if linears in ("nvfp4", "delayed", "current") else Format.E4M3
    expected = (
        linear_recipe
        if linears == "delayed"
        else DelayedScaling(fp8_format=fmt, amax_history_len=1, amax_compute_algo="most_recent")
    )
    for kind in ("probs", "grad_scores"):
        state = sites[f"{CORE}.{kind}"].state
        assert isinstance(state, DelayedScalingState) and state.recipe == expected and state.steps == 2
        assert sites[f"{CORE}.{kind}"].history_amax > 0
    assert all(isinstance(sites[f"{CORE}.{k}"].state, CurrentScalingState) for k in ("q", "output", "grad_output"))
    assert sites[f"{CORE}.grad_scores"].fmt is fmt.bwd and sites[f"{CORE}.probs"].fmt is fmt.fwd


@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4"])
def test_delayed_attention_under_a_block_recipe_keeps_an_amax_history(recipe):
    """The core's sites get delayed scaling with the group's history and algorithm (HYBRID under
    NVFP4, whose fp8_format is its block scales'), and its scale follows the history; the linears
    stay block-scaled and unchanged."""
    overrides = (
        f"precision.recipe={recipe}",
        "precision.amax_history_len=4",
        "precision.amax_compute_algo=most_recent",
    )
    losses, model = _trained(*overrides, "attention.recipe=delayed")
    null_losses, _ = _trained(*overrides)
    sites = model.numerics.sites
    output = sites[f"{CORE}.output"]
    assert isinstance(output.state, DelayedScalingState) and output.state.steps == 2
    assert output.state.recipe == DelayedScaling(
        fp8_format=Format.HYBRID if recipe == "nvfp4" else Format.E4M3,
        amax_history_len=4,
        amax_compute_algo="most_recent",
    )
    assert len(output.state.history) == 4 and output.history_amax is not None and output.history_amax > 0
    grad = sites[f"{CORE}.grad_output"]
    assert grad.fmt is (E5M2 if recipe == "nvfp4" else E4M3) and isinstance(grad.state, DelayedScalingState)
    assert not isinstance(sites["layers.0.mlp.up.input"].state, DelayedScalingState)
    assert type(model.numerics.recipe).__name__ == {"mxfp8": "MXFP8BlockScaling", "nvfp4": "NVFP4BlockScaling"}[recipe]
    assert losses[0] != null_losses[0]  # step 1: the delayed scale is 1 (no history yet), not O's own


def test_the_linears_read_nothing_of_the_attention_recipe():
    """One linear and one attention call under MXFP8 with and without a delayed attention recipe:
    the linear's output is the same bits, the core's differs once its history holds an amax."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(4, 8, 64, generator=g), torch.randn(32, 64, generator=g)
    q, k, v = (torch.randn(2, 2, 32, 16, generator=g) * 4 for _ in range(3))
    outputs = []
    for own in (None, "delayed"):  # in MXFP8's format, E4M3
        numerics = Numerics(make_spec(recipe=MXFP8BlockScaling(), amax_history_len=2, attention={"recipe": own}))
        for _ in range(2):
            y = linear(x, w, numerics, "layers.0.mlp.up")
            o, _ = attention(q, k, v, numerics, CORE)
            numerics.end_step()
        outputs.append((y, o))
    (y0, o0), (y1, o1) = outputs
    assert torch.equal(y0, y1) and not torch.equal(o0, o1)


def test_a_checkpoint_restores_the_attention_sites_with_their_own_recipe():
    """``load_state_dict`` makes the sites from their names before any op runs: the core's get
    the attention recipe's state back, history and all."""
    spec_kwargs = dict(recipe=MXFP8BlockScaling(), amax_history_len=3, attention={"recipe": "delayed"})
    numerics = Numerics(make_spec(**spec_kwargs))
    numerics.site(f"{CORE}.output").quantize(torch.linspace(-3, 2, 16))
    numerics.site("layers.0.mlp.up.input").quantize(torch.ones(4))
    numerics.end_step()
    resumed = Numerics(make_spec(**spec_kwargs))
    resumed.load_state_dict(numerics.state_dict())
    state = resumed.sites[f"{CORE}.output"].state
    assert isinstance(state, DelayedScalingState) and state.history.tolist() == [3.0, 0.0, 0.0]
    assert isinstance(resumed.sites["layers.0.mlp.up.input"].state, CurrentScalingState)


def test_the_spec_takes_a_per_tensor_attention_recipe_of_an_fp8_run_and_pickles_it():
    spec = make_spec(recipe=CurrentScaling(), amax_history_len=5, attention={"recipe": "delayed"})
    assert pickle.loads(pickle.dumps(spec)).attention_recipe == DelayedScaling(amax_history_len=5)
    assert spec.recipe_for(f"{CORE}.q").KEY == "delayed" and spec.recipe_for("layers.0.attn.qkv.input").KEY == "current"
    with pytest.raises(ConfigError, match=r"attention\.recipe"):
        make_spec(recipe=CurrentScaling(), attention={"recipe": "mxfp8"})  # not emulated
    assert make_spec("bf16", attention={"recipe": "delayed"}).attention_recipe is None  # FP8 only


def test_an_amax_spike_needs_a_history_somewhere():
    spike = {"site": "attn.core.output", "step": 2, "k": 3}

    def settings(linears: ScalingRecipe, core: str) -> NumericsSettings:
        attention = AttentionSettings(bwd_precision="fp8", bwd_reads="forward", recipe=core)
        return NumericsSettings(fp8_settings_of(linears, amax_spike=spike), attention, "reuse_rounded")

    settings(CurrentScaling(), "delayed").check()
    settings(DelayedScaling(), "current").check()
    with pytest.raises(ConfigError, match="delayed scaling"):
        settings(CurrentScaling(), "current").check()


def test_the_recipe_object_takes_the_groups_fields_but_the_linears_own():
    """``AttentionSettings.scaling_recipe``: margin, history, algorithm and interval from the
    group, the linears' format (HYBRID under NVFP4), never the linears' backward switches."""
    cfg = config(
        "+experiment=reuse_rounded",
        "precision.recipe=current",
        "precision.fp8_format=E4M3",
        "precision.backward_override=dequantized",
        "precision.margin=2",
        "precision.amax_history_len=8",
        "attention.recipe=delayed",
    )
    own = numerics_spec(cfg.numerics).attention_recipe
    assert own == DelayedScaling(margin=2, fp8_format=Format.E4M3, amax_history_len=8)
    assert numerics_spec(cfg.numerics).recipe.backward_override == "dequantized"
