"""Configs: every experiment composes, validates and sets only the study's axes (each one trains
through the real ``train.py``: tests/integration/test_experiments.py)."""

import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from readback.config import Config, validate
from readback.config.refusals import options
from readback.errors import ConfigError
from readback.numerics import DelayedScaling, Format
from toys import ALL_EXPERIMENTS, compose, config

STUDY_AXES = {"precision", "policy", "attention", "experiment"}


def test_the_study_experiments_exist():
    assert ALL_EXPERIMENTS == [
        "bf16_baseline",
        "fresh_reround",
        "no_saved_copy",
        "original_bf16_bwd",
        "reuse_rounded",
        "reuse_rounded_bf16_bwd",
    ]


@pytest.mark.parametrize("experiment", ALL_EXPERIMENTS)
def test_experiment_composes_validates_and_sets_only_the_study_axes(experiment):
    base = OmegaConf.to_container(compose())
    cfg = compose(f"+experiment={experiment}")
    validate(cfg)
    changed = {key for key, value in OmegaConf.to_container(cfg).items() if base.get(key) != value}
    assert changed <= STUDY_AXES, changed
    assert cfg.experiment == experiment
    # model=, data= and trainer.* stay free under an experiment
    free = compose(f"+experiment={experiment}", "model=small", "data=synthetic", "trainer.steps=7")
    assert (free.model.name, free.data.name, free.trainer.steps) == ("small", "synthetic", 7)


@pytest.mark.parametrize(
    "experiment, precision, policy, bwd",
    [
        ("reuse_rounded", "fp8", "reuse_rounded", "fp8"),
        ("fresh_reround", "fp8", "fresh_reround", "fp8"),
        ("no_saved_copy", "fp8", "no_saved_copy", "fp8"),
        ("reuse_rounded_bf16_bwd", "fp8", "reuse_rounded", "bf16"),
        ("original_bf16_bwd", "fp8", "original", "bf16"),
        ("bf16_baseline", "bf16", "exact", "bf16"),
    ],
)
def test_experiment_axes(experiment, precision, policy, bwd):
    cfg = compose(f"+experiment={experiment}")
    assert (cfg.precision.name, cfg.policy, cfg.attention.bwd_precision) == (precision, policy, bwd)


def test_the_study_recipe_is_transformer_engine_default_delayed_scaling():
    p = config("+experiment=reuse_rounded").precision
    assert p.scaling_recipe() == DelayedScaling(fp8_format=Format.HYBRID, margin=0, amax_history_len=1024)
    assert p.scaling_recipe().amax_compute_algo == "max"
    assert list(p.bf16_layers) == ["lm_head"] and p.rounding == "nearest"


@pytest.mark.parametrize(
    ("recipe", "fmt"),
    [("delayed", Format.HYBRID), ("current", Format.HYBRID), ("mxfp8", Format.E4M3), ("nvfp4", Format.E4M3)],
)
def test_a_null_fp8_format_is_the_recipe_own_default_as_in_transformer_engine(recipe, fmt):
    p = config("+experiment=reuse_rounded", f"precision.recipe={recipe}").precision
    assert p.fp8_format is None and p.scaling_recipe().fp8_format is fmt
    hybrid = compose("+experiment=reuse_rounded", f"precision.recipe={recipe}", "precision.fp8_format=HYBRID")
    if recipe == "nvfp4":  # its block scales are E4M3, and TE asserts it
        with pytest.raises(ConfigError, match=r"precision.fp8_format='HYBRID'.*E4M3 or null"):
            validate(hybrid)
    else:
        assert (
            config("+experiment=reuse_rounded", f"precision.recipe={recipe}", "precision.fp8_format=HYBRID")
            .precision.scaling_recipe()
            .fp8_format
            is Format.HYBRID
        )


@pytest.mark.parametrize(
    "override, key",
    [
        ("model.n_heads=3", "model.n_heads"),
        ("model.ffn_dim=200", "model.ffn_dim"),
        ("trainer.micro_batch=5", "trainer.micro_batch"),
        ("precision.interval=0", "precision.interval"),
        ("probe.repeats=0", "probe.repeats"),
    ],
)
def test_validate_names_the_bad_key(override, key):
    with pytest.raises(ConfigError) as error:
        validate(compose(override))
    assert error.value.key == key and "valid:" in str(error.value)


@pytest.mark.parametrize(
    "override",
    [
        f"{group}={option}"
        for group in ("model", "precision", "policy", "data", "backend", "logger")
        for option in options(group)
    ],
)
def test_every_option_sets_every_key_of_its_schema(override):
    """``to_object`` refuses a field no YAML file sets (``???``) and runs every range check."""
    assert isinstance(OmegaConf.to_object(compose(override)), Config)


def test_validate_gives_the_typed_config_and_refuses_plus_keys():
    config = validate(compose("trainer.steps=7"))
    assert isinstance(config, Config) and config.trainer.steps == 7 and config.trainer.optim.eps == 1e-8
    with pytest.raises(ConfigError, match=r"trainer.max_steps=100 is not a config key; did you mean trainer.steps"):
        validate(compose("+trainer.max_steps=100"))


def test_bf16_allows_widths_fp8_refuses():
    validate(compose("+experiment=bf16_baseline", "model.ffn_dim=200"))
    with pytest.raises(ConfigError):
        validate(compose("+experiment=reuse_rounded", "model.ffn_dim=200"))


@pytest.mark.parametrize(
    "overrides, key, value, bound",
    [
        # HYBRID: the forward sites are E4M3, the strictest: 448 x 2^-19 rounds to zero
        (["precision.margin=19"], "precision.margin", 19, "[0, 18] for the E4M3 sites"),
        (["precision.margin=19", "precision.fp8_format=E4M3"], "precision.margin", 19, "(all sites)"),
        # a site margin adds to the global margin, at each site in that site's format
        (["precision.site_margin={attn.core.output:19}"], "precision.site_margin.attn.core.output", 19, "at most 18"),
        (
            ["precision.margin=10", "precision.site_margin={attn.core.*:5,attn.core.output:4}"],
            "precision.site_margin.attn.core.*",
            5,
            "at most 18 at the E4M3 site layers.0.attn.core.output (here precision.margin=10 + site margins 5 + 4",
        ),
        # gradients are E5M2 under HYBRID (57344 x 2^-33 rounds to zero) and E4M3 under fp8_format=E4M3
        (["precision.site_margin={grad_output:33}"], "precision.site_margin.grad_output", 33, "E5M2 site"),
        (
            ["precision.fp8_format=E4M3", "precision.site_margin={grad_output:19}"],
            "precision.site_margin.grad_output",
            19,
            "at most 18 at the E4M3 site layers.0.attn.qkv.grad_output",
        ),
    ],
)
def test_margins_that_round_even_the_amax_to_zero_are_refused(overrides, key, value, bound):
    with pytest.raises(ConfigError) as error:
        validate(compose(*overrides))
    assert (error.value.key, error.value.value) == (key, value) and bound in str(error.value)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    "overrides",
    [
        ["precision.margin=18"],
        ["precision.site_margin={grad_output:32}"],  # E5M2 under HYBRID
        ["precision.margin=8", "precision.site_margin={attn.core.*:5,attn.core.output:5}"],  # 18
        ["precision.site_margin={lm_head.input:40}"],  # lm_head is BF16 (bf16_layers): unscaled
    ],
)
def test_margins_below_the_bound_of_their_sites_format_are_kept(overrides):
    validate(compose(*overrides))


def test_a_bad_command_line_is_refused_without_loading_the_trainer():
    """The config's schemas load without ``readback.train.launch`` (and the checkpoint code it
    imports): every refusal of a command line would pay for it, in a process of its own."""
    code = (
        "import sys, readback.config, readback.train;"
        "print(sorted(m for m in ('readback.train.launch', 'torch.distributed.checkpoint') if m in sys.modules));"
        "readback.train.run;"
        "print('readback.train.launch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split("\n")[:2] == ["[]", "True"], out
