"""One Transformer Engine recipe for both TE paths: a ``backend=te`` FOG run (``te_plan``) and a
model converted with ``convert(backend="te")`` must get the same recipe class and keyword
arguments from the same precision settings, and refuse the same settings in the same words.

Runs without Transformer Engine: its recipe classes are stand-ins that record their arguments.
"""

from __future__ import annotations

import dataclasses
import re
import types

import pytest

from readback.backends.te import convert as convert_te
from readback.backends.te import facts as te_facts
from readback.backends.te import parts as te_backend
from readback.backends.te import plan as te_plan
from readback.backends.te import recipe as te_recipe
from readback.backends.te.facts import Hardware
from readback.errors import ConfigError
from readback.numerics import DelayedScaling
from readback.numerics.state import Numerics
from readback.ops import numerics_spec
from toys import REPO
from toys import config as compose

H100 = Hardware((9, 0), (9, 13, 0))
B200 = Hardware((10, 0), (9, 14, 0))

# Every recipe, and every refusal of a recipe field (fresh_reround: readback's attention core,
# so the FOG recipe has no FP8 attention either, like a converted model's linears).
PRECISIONS = [
    (),
    ("precision.margin=2", "precision.fp8_format=E4M3", "precision.amax_history_len=16"),
    ("precision.amax_compute_algo=most_recent",),
    ("precision.recipe=current",),
    ("precision.recipe=current", "precision.fp8_format=E4M3"),
    ("precision.recipe=current", "precision.margin=1"),
    ("precision.interval=2",),
    ("precision.override_linear_precision=[false,false,true]",),
    ("precision.rounding=stochastic",),
]
VERSIONS = ["1.13.0", "2.8.0", "2.15.0"]


def _recording_recipes() -> types.SimpleNamespace:
    """``transformer_engine.common.recipe`` with classes that keep their keyword arguments."""

    def recipe_class(name: str) -> type:
        return type(name, (), {"__init__": lambda self, **kwargs: setattr(self, "kwargs", kwargs)})

    formats = types.SimpleNamespace(HYBRID="Format.HYBRID", E4M3="Format.E4M3", E5M2="Format.E5M2")
    return types.SimpleNamespace(Format=formats, **{name: recipe_class(name) for name in te_recipe.RECIPES.values()})


def _built(make) -> tuple[str, dict] | str:
    """``(recipe class, keyword arguments)`` of what ``make()`` returns, or its refusal's line."""
    try:
        recipe = make()
    except ConfigError as error:
        return str(error)
    return type(recipe).__name__, recipe.kwargs


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("overrides", PRECISIONS, ids=lambda o: " ".join(o) or "defaults")
def test_converted_model_gets_the_fog_runs_te_recipe(monkeypatch, overrides, version):
    monkeypatch.setattr(te_backend, "_TE", (types.SimpleNamespace(), _recording_recipes()))
    for module in (te_facts, te_recipe):
        monkeypatch.setattr(module, "installed_te_version", lambda: version)
        monkeypatch.setattr(module, "installed_hardware", lambda: H100)
    cfg = compose("+experiment=fresh_reround", "backend=te", *overrides)

    fog = _built(lambda: te_backend.make_recipe(te_plan.te_plan(cfg, version, H100).te_recipe, version))
    converted = _built(lambda: convert_te.te_recipe(Numerics(numerics_spec(cfg.numerics), seed=cfg.seed)))
    assert converted == fog


def test_converted_recipe_pins_backward_override_from_te_2_15():
    recipe = te_recipe.te_recipe_plan(DelayedScaling(), "nearest", "2.15.0", H100)
    assert recipe is not None and recipe.kwargs["backward_override"] is None
    older = te_recipe.te_recipe_plan(DelayedScaling(), "nearest", "2.14.0", H100)
    assert older is not None and "backward_override" not in older.kwargs


def test_mxfp8_recipe_is_block_scaling_where_the_gpu_has_it():
    precision = compose("+experiment=fresh_reround", "backend=te", "precision.recipe=mxfp8").precision
    recipe = te_recipe.te_recipe_plan(precision.scaling_recipe(), precision.rounding, "2.8.0", B200)
    assert recipe == te_recipe.TERecipe("MXFP8BlockScaling", {"fp8_format": "E4M3"})
    with pytest.raises(ConfigError, match=r"^precision.recipe='mxfp8' is not valid"):
        te_recipe.te_recipe_plan(precision.scaling_recipe(), precision.rounding, "2.8.0", H100)


def test_convert_runs_block_scaling_in_the_emulated_linears():
    """No per-tensor stand-in: a converted linear under MXFP8 quantises by blocks, its wgrad reading
    X's own columnwise copy (``ops.linear.recipe_reads``)."""
    import torch
    import torch.nn as nn

    from readback import convert
    from readback.numerics import MXFP8BlockScaling

    model = nn.Sequential(nn.Linear(32, 32, bias=False))
    numerics = convert(model, precision={"recipe": "mxfp8"}, policy="reuse_rounded").numerics
    assert isinstance(numerics.recipe, MXFP8BlockScaling) and numerics.spec.reads["linear"]["wgrad"] == "requantized"
    model(torch.randn(64, 32)).sum().backward()
    assert model[0].weight.grad is not None


@pytest.mark.parametrize(("recipe", "handed"), [("delayed", True), ("mxfp8", False)])
def test_a_norm_hands_its_rounded_output_only_under_per_tensor_scaling(recipe, handed):
    """Under a block recipe the linear after a norm quantises the norm's output by blocks itself
    (TE's LayerNormLinear), rather than multiplying a per-tensor copy the norm made."""
    import torch
    import torch.nn as nn

    from readback import convert

    model = nn.Sequential(nn.RMSNorm(32), nn.Linear(32, 32, bias=False))
    numerics = convert(model, precision={"recipe": recipe}, policy="reuse_rounded").numerics
    with numerics.taping() as tape:
        model(torch.randn(64, 32))
    assert ("0.output" in numerics.sites) is handed
    (x_q,) = [record["input"] for site, record in tape if site == "1"]
    assert type(x_q).__name__ == ("QTensor" if handed else "BlockQTensor")


@pytest.mark.parametrize("overrides", [("precision.recipe=mxfp8",), ("precision.recipe=mxfp8", "precision.margin=1")])
def test_the_numerics_of_an_mxfp8_te_run_give_convert_the_same_block_scaling_recipe(monkeypatch, overrides):
    """One recipe object from the config to the kernel: the ``Numerics`` that ``backend=te`` builds
    under MXFP8 carries MXFP8, so ``convert(backend="te")`` given it makes TE's MXFP8 recipe too,
    never the per-tensor stand-in that readback's own ops scale with."""
    monkeypatch.setattr(te_backend, "_TE", (types.SimpleNamespace(), _recording_recipes()))
    for module in (te_facts, te_recipe):
        monkeypatch.setattr(module, "installed_te_version", lambda: "2.8.0")
        monkeypatch.setattr(module, "installed_hardware", lambda: B200)
    cfg = compose("+experiment=fresh_reround", "backend=te", *overrides)
    plan = te_plan.te_plan(cfg, "2.8.0", B200)

    fog = _built(lambda: te_backend.make_recipe(plan.te_recipe, "2.8.0"))
    converted = _built(lambda: convert_te.te_recipe(te_backend.readback_numerics(cfg)))
    assert fog[0] == "MXFP8BlockScaling" and converted == fog


def test_the_recipe_defaults_are_declared_once_by_the_recipe_object():
    """A run's config, ``convert`` and the recipe dataclass agree because only the dataclass
    holds the defaults: the YAML file sets no recipe field and convert restates none."""
    import torch.nn as nn
    import yaml

    from readback import convert
    from readback.numerics import RECIPES, Format, MXFP8BlockScaling

    assert compose().precision.scaling_recipe() == DelayedScaling()
    assert convert(nn.Sequential(nn.Linear(16, 16)), "fp8").numerics.recipe == DelayedScaling()
    recipe_fields = {f.name for cls in RECIPES.values() for f in dataclasses.fields(cls)} | {"recipe"}
    for group in ("fp8", "bf16"):
        keys = set(yaml.safe_load((REPO / "conf" / "precision" / f"{group}.yaml").read_text()))
        assert not keys & recipe_fields and keys <= {"defaults", "name", "bf16_layers"}, keys
    assert MXFP8BlockScaling().fp8_format is Format.E4M3  # TE's own default for this recipe, the config's too


def test_float8_block_scaling_takes_te_s_fields_and_defaults_and_its_refusals():
    """``precision.recipe=blockwise`` is TE's ``Float8BlockScaling`` (TE 2.20's fields and
    defaults); TE's own asserts are the config's refusals; ``backward_override`` is passed to
    TE from 2.15 on and refused before, and under delayed scaling everywhere."""
    from readback.numerics import Float8BlockScaling, Format

    default = Float8BlockScaling()
    assert (default.fp8_format, default.x_block_scaling_dim, default.w_block_scaling_dim) == (Format.E4M3, 1, 2)
    assert (default.grad_block_scaling_dim, default.pow2_scales, default.amax_epsilon) == (1, True, 0.0)
    te = ("+experiment=fresh_reround", "backend=te", "precision.recipe=blockwise")
    cfg = compose(*te, "backend.attention_core=readback")
    assert cfg.precision.scaling_recipe() == default  # fp8_format null: the recipe's own, E4M3
    plan = te_plan.te_plan(cfg, "2.20.0", H100)
    assert plan.te_recipe.name == "Float8BlockScaling" and "fp8_dpa" not in plan.te_recipe.kwargs
    auto = compose("+experiment=reuse_rounded", "backend=te", "precision.recipe=blockwise")
    assert te_plan.te_plan(auto, "2.20.0", H100).attention_core == "readback"  # TE's FP8 attention: refused
    assert plan.te_recipe.kwargs["w_block_scaling_dim"] == 2 and plan.te_recipe.kwargs["backward_override"] is None
    refusals = {
        ("precision.backward_override=dequantized",): "precision.backward_override='dequantized'",
        ("precision.recipe=blockwise", "precision.margin=1"): "precision.margin=1",
        (
            "precision.recipe=blockwise",
            "precision.x_block_scaling_dim=2",
        ): "precision.[x, w, grad]_block_scaling_dim=[2, 2, 1]",
        ("precision.recipe=blockwise", "precision.x_block_scaling_dim=3"): "precision.x_block_scaling_dim=3",
    }
    for overrides, line in refusals.items():
        with pytest.raises(ConfigError, match="^" + re.escape(line)):
            compose("+experiment=fresh_reround", *overrides)
    for overrides, version, hw, line in [
        (("backend.attention_core=readback",), "2.2.0", H100, "needs >= 2.3"),
        (("backend.attention_core=readback",), "2.20.0", Hardware((8, 9)), "needs sm90"),
        (("backend.attention_core=readback", "precision.pow2_scales=false"), "2.20.0", B200, "power-of-two"),
        (("backend.attention_core=readback", "precision.pow2_scales=false"), "2.20.0", H100, "NVTE_FP8_BLOCK"),
        (("backend.attention_core=readback", "precision.backward_override=dequantized"), "2.8.0", H100, "2.15"),
    ]:
        with pytest.raises(ConfigError, match=line):
            te_plan.te_plan(compose(*te, *overrides), version, hw)
    with_override = compose(*te, "backend.attention_core=readback", "precision.backward_override=high_precision")
    assert te_plan.te_plan(with_override, "2.20.0", H100).te_recipe.kwargs["backward_override"] == "high_precision"


def test_the_emulated_backend_runs_the_block_recipes_and_refuses_what_their_quantisers_lack():
    for recipe in ("mxfp8", "blockwise"):
        assert compose("+experiment=reuse_rounded", f"precision.recipe={recipe}").precision.recipe == recipe
        with pytest.raises(ConfigError, match=r"^precision.rounding='stochastic' is not valid; valid: nearest under"):
            compose("+experiment=reuse_rounded", f"precision.recipe={recipe}", "precision.rounding=stochastic")


NVFP4_SWITCHES = ("disable_rht", "disable_stochastic_rounding", "disable_2d_quantization")


@pytest.mark.parametrize("switch", [None, *NVFP4_SWITCHES])
def test_nvfp4_recipe_passes_te_s_switches_and_pins_the_fields_te_reads_from_the_environment(switch):
    """``precision.recipe=nvfp4`` is TE's ``NVFP4BlockScaling``: its three switches are passed
    always (TE's defaults are NVTE_NVFP4_* variables read at import), and the fields readback does
    not model are pinned off where this TE has them (row_scaled_activation from 2.16, nvfp4_4over6
    from 2.17), as backward_override is from 2.15; no FP8 attention switch is set."""
    overrides = ("precision.recipe=nvfp4", *([f"precision.{switch}=true"] if switch else []))
    precision = compose("+experiment=fresh_reround", "backend=te", *overrides).precision
    recipe = precision.scaling_recipe()
    switches = {name: name == switch for name in NVFP4_SWITCHES}
    plans = {v: te_recipe.te_recipe_plan(recipe, precision.rounding, v, B200) for v in ("2.8.0", "2.16.0", "2.20.0")}
    assert plans["2.8.0"] == te_recipe.TERecipe("NVFP4BlockScaling", {"fp8_format": "E4M3", **switches})
    assert plans["2.16.0"].kwargs == {"fp8_format": "E4M3", **switches, "row_scaled_activation": False} | {
        "backward_override": None
    }
    assert plans["2.20.0"].kwargs == {
        "fp8_format": "E4M3",
        **switches,
        "row_scaled_activation": False,
        "nvfp4_4over6": "none",
        "backward_override": None,
    }
    assert plans["2.20.0"].for_attention(fp8_dpa=True, fp8_mha=True) == plans["2.20.0"]


def test_nvfp4_needs_sm100_and_te_2_8_and_refuses_what_te_has_not():
    te = ("+experiment=fresh_reround", "backend=te", "precision.recipe=nvfp4")
    recipe = compose(*te).precision.scaling_recipe()
    for hw in (B200, Hardware((12, 0), (9, 14, 0)), Hardware()):  # TE checks capability >= 10.0 only
        assert te_recipe.te_recipe_plan(recipe, "nearest", "2.20.0", hw).name == "NVFP4BlockScaling"
    with pytest.raises(ConfigError) as error:
        te_recipe.te_recipe_plan(recipe, "nearest", "2.20.0", H100)
    assert str(error.value) == (
        "precision.recipe='nvfp4' is not valid; valid: delayed, current, blockwise (Transformer Engine "
        "2.20.0 on sm90, cuDNN 9.13.0: NVFP4BlockScaling needs sm100 or newer)"
    )
    with pytest.raises(ConfigError, match=r"^precision.recipe='nvfp4' .*has no NVFP4BlockScaling; it needs >= 2.8"):
        te_recipe.te_recipe_plan(recipe, "nearest", "2.7.0", B200)
    for overrides, version, line in [
        (("precision.override_linear_precision=[false,false,true]",), "2.20.0", "no override_linear_precision"),
        (("precision.backward_override=dequantized",), "2.14.0", "needs >= 2.15"),
        (("precision.rounding=stochastic",), "2.20.0", "nearest under precision.recipe=nvfp4"),
        (("precision.margin=1",), "2.20.0", "no margin"),
    ]:
        with pytest.raises(ConfigError, match=line):
            precision = compose(*te, *overrides).precision
            te_recipe.te_recipe_plan(precision.scaling_recipe(), precision.rounding, version, B200)
    dequantized = compose(*te, "precision.backward_override=dequantized").precision.scaling_recipe()
    assert te_recipe.te_recipe_plan(dequantized, "nearest", "2.15.0", B200).kwargs["backward_override"] == "dequantized"


def test_a_refused_block_recipe_offers_only_recipes_this_gpu_and_te_run():
    mxfp8 = compose("+experiment=fresh_reround", "backend=te", "precision.recipe=mxfp8").precision.scaling_recipe()
    with pytest.raises(ConfigError, match=r"valid: delayed, current, blockwise \(Transformer Engine 2.20.0 on sm90"):
        te_recipe.te_recipe_plan(mxfp8, "nearest", "2.20.0", H100)  # not nvfp4: sm100 too
    with pytest.raises(ConfigError, match=r"valid: delayed, current \(Transformer Engine 2.2.0 on sm90"):
        te_recipe.te_recipe_plan(mxfp8, "nearest", "2.2.0", H100)  # blockwise: TE >= 2.3


def test_the_fog_run_and_convert_make_the_same_nvfp4_recipe_from_te_s_format(monkeypatch):
    """``te.make_recipe`` turns the plan into ``NVFP4BlockScaling(fp8_format=Format.E4M3, ...)``,
    and ``convert(backend="te")`` given the run's numerics makes the same call."""
    monkeypatch.setattr(te_backend, "_TE", (types.SimpleNamespace(), _recording_recipes()))
    for module in (te_facts, te_recipe):
        monkeypatch.setattr(module, "installed_te_version", lambda: "2.20.0")
        monkeypatch.setattr(module, "installed_hardware", lambda: B200)
    cfg = compose("+experiment=fresh_reround", "backend=te", "precision.recipe=nvfp4", "precision.disable_rht=true")
    plan = te_plan.te_plan(cfg, "2.20.0", B200)

    fog = _built(lambda: te_backend.make_recipe(plan.te_recipe, "2.20.0"))
    converted = _built(lambda: convert_te.te_recipe(te_backend.readback_numerics(cfg)))
    assert converted == fog and fog[0] == "NVFP4BlockScaling"
    assert fog[1]["fp8_format"] == "Format.E4M3" and fog[1]["disable_rht"] is True
