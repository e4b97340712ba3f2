"""backend=te: the pure config -> Transformer Engine mapping (any machine), the model wiring on a
stand-in for Transformer Engine's modules (CPU), and the real thing (CUDA + Transformer Engine)."""

from __future__ import annotations

import importlib.util
import math
import sys
import types
from contextlib import nullcontext
from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from readback import backends
from readback.backends.te import parts as te_backend
from readback.backends.te.facts import Hardware, cudnn_version, version_tuple
from readback.backends.te.plan import te_plan
from readback.errors import ConfigError
from readback.model import ActivationStats
from readback.model.fog import AttentionCore
from readback.model.fog import Linear as ReadbackLinear
from readback.numerics import E4M3, CurrentScalingState, MXFP8BlockScaling
from readback.numerics.scale_state import new_state
from toys import REPO
from toys import config as typed_config

HAS_TE = torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None
needs_te = pytest.mark.skipif(not HAS_TE, reason="needs CUDA and transformer_engine")
TE2 = "2.8.0"


SMALL_DATA = ("data=synthetic", "data.vocab_size=64")  # a vocabulary every model size here can hold


def config(experiment: str | None = None, *overrides: str, backend: str = "te"):
    args = ([f"+experiment={experiment}"] if experiment else []) + [f"backend={backend}", *SMALL_DATA, *overrides]
    return typed_config(*args)


# --------------------------------------------------------------------------- the pure mapping

H100 = Hardware((9, 0), (9, 13, 0))
B200 = Hardware((10, 0), (9, 14, 0))
HD128 = ("model.d_model=512", "model.n_heads=4")  # head dim 128, as fog_390m's
PINNED = {"NVTE_FUSED_ATTN": "1", "NVTE_FLASH_ATTN": "0"}
LINEARS_RECIPE = {"NVTE_DPA_FP8_RECIPE": ""}  # FP8 attention under the linears' recipe, pinned (TE >= 2.8)
# and under current scaling, the DelayedScaling of S and dP, pinned to TE's defaults (the emulation's)
S_DP_DELAYED = {
    "NVTE_DPA_FP8DS_AMAX_HISTLEN": "1",
    "NVTE_DPA_FP8DS_AMAX_ALGO": "most_recent",
    "NVTE_DPA_FP8DS_REDUCE_AMAX": "1",
}

# experiment -> (TE recipe, fp8_dpa, env, attention core)
EXPERIMENTS = {
    "reuse_rounded": ("DelayedScaling", True, {"NVTE_FP8_DPA_BWD": "1", **LINEARS_RECIPE, **PINNED}, "te"),
    "reuse_rounded_bf16_bwd": ("DelayedScaling", True, {"NVTE_FP8_DPA_BWD": "0", **LINEARS_RECIPE, **PINNED}, "te"),
    "fresh_reround": ("DelayedScaling", False, {}, "readback"),
    "no_saved_copy": ("DelayedScaling", False, {}, "readback"),
    "bf16_baseline": (None, None, PINNED, "te"),
}


@pytest.mark.parametrize("experiment", sorted(EXPERIMENTS))
def test_experiment_maps_to_te_recipe_switches_and_sites(experiment):
    recipe, fp8_dpa, env, core = EXPERIMENTS[experiment]
    plan = te_plan(config(experiment, *HD128), TE2, H100)
    assert (plan.recipe, plan.env, plan.attention_core) == (recipe, env, core)
    if recipe is None:
        assert not plan.fp8 and plan.recipe_kwargs == {}
        assert plan.sites["attention_core"] == "te.DotProductAttention(bf16)"
    else:
        assert plan.recipe_kwargs == dict(
            margin=0,
            fp8_format="HYBRID",
            amax_history_len=1024,
            amax_compute_algo="max",
            fp8_dpa=fp8_dpa,
            fp8_mha=False,
        )
    assert plan.sites["linear"].startswith("te.Linear") and plan.sites["norm"] == "te.RMSNorm"
    if core == "te":
        assert plan.sites["attention_core"].startswith("te.DotProductAttention")
        assert plan.sites["attn_proj"].startswith("te.Linear")
    else:
        assert plan.sites["attention_core"].startswith("readback.ops.attention")  # on the Triton kernel, or not
        assert plan.sites["attn_proj"].startswith("readback.ops.linear")
    assert plan.sites["lm_head"] == "torch BF16 matmul (tied embedding)"  # the study's BF16 LM head


def test_site_labels_name_the_te_switches():
    sites = te_plan(config("reuse_rounded_bf16_bwd"), TE2).sites
    assert sites["attention_core"] == (
        "te.DotProductAttention(fp8_dpa; DelayedScaling; NVTE_FP8_DPA_BWD=0; D reads O8 dequantised to BF16)"
    )


# (experiment overrides) -> what D, dQ and dV read (TE's FusedAttnFunc.forward, v2.8 and 2.20)
READS = [
    (("+experiment=reuse_rounded",), "O8 (the core's output_fp8)", "rounded K8"),
    (("+experiment=reuse_rounded_bf16_bwd",), "O8 dequantised to BF16", "original K (BF16)"),
    (("+experiment=reuse_rounded", "policy=original", "precision.recipe=current"), "original O (F16)", "rounded K8"),
    (
        ("+experiment=reuse_rounded", "precision.recipe=current"),
        "O8 (quantised by the core's O quantizer)",
        "rounded K8",
    ),
    (
        (
            "+experiment=reuse_rounded",
            "policy=original",
            "precision.recipe=current",
            "attention.bwd_precision=bf16",
            "attention.bwd_reads=te",
        ),
        "original O (F16)",
        "original K (BF16)",
    ),
    # a BF16 backward that reads the forward's Q8, K8, V8 is no TE switch: readback's core runs it
    (("+experiment=reuse_rounded_bf16_bwd", "attention.bwd_reads=forward"), "rounded O", "rounded K"),
    (("+experiment=fresh_reround",), "a fresh rounding of O", "rounded K"),
    (("+experiment=no_saved_copy",), "no O: D = rowsum(P * dP)", "rounded K"),
]


@pytest.mark.parametrize("overrides, d_read, dq_read", READS)
def test_plan_records_what_each_attention_gradient_reads(overrides, d_read, dq_read):
    cfg = typed_config(*overrides, "backend=te", *SMALL_DATA, *HD128)
    sites = te_plan(cfg, TE2, B200).sites
    assert (sites["attention_core.D"], sites["attention_core.dQ"]) == (d_read, dq_read)
    assert {f"attention_core.{g}" for g in ("D", "dQ", "dK", "dV", "dP", "dS")} <= set(sites)


def test_bf16_backward_under_current_scaling_reads_the_f16_o_so_reuse_rounded_has_no_te_switch():
    """NVTE_FP8_DPA_BWD=0 saves the F16 O under current scaling whatever NVTE_DPA_FP8CS_O_in_F16
    says: TE cannot run reuse_rounded there, and original needs no O_in_F16 switch."""
    for reads in ("forward", "te"):
        bf16_bwd = ("precision.recipe=current", "attention.bwd_precision=bf16", f"attention.bwd_reads={reads}")
        assert te_plan(config("reuse_rounded", *bf16_bwd, *HD128), TE2, B200).attention_core == "readback"
    bf16_bwd = ("policy=original", "precision.recipe=current", "attention.bwd_precision=bf16")
    plan = te_plan(config("reuse_rounded", *bf16_bwd, "attention.bwd_reads=te", *HD128), TE2, B200)
    assert plan.env == {"NVTE_FP8_DPA_BWD": "0", **LINEARS_RECIPE, **S_DP_DELAYED, **PINNED}
    assert plan.attention_core == "te"


@pytest.mark.parametrize("policy, o_in_f16", [("original", "1"), ("reuse_rounded", "0")])
def test_current_scaling_fp8_backward_switches(policy, o_in_f16):
    cfg = config("reuse_rounded", f"policy={policy}", "precision.recipe=current", *HD128)
    plan = te_plan(cfg, TE2, B200)
    assert plan.recipe == "Float8CurrentScaling" and plan.attention_core == "te"
    assert plan.recipe_kwargs == dict(fp8_format="HYBRID", fp8_dpa=True, fp8_mha=False)
    expected = {"NVTE_FP8_DPA_BWD": "1", "NVTE_DPA_FP8CS_O_in_F16": o_in_f16, **LINEARS_RECIPE, **S_DP_DELAYED}
    assert plan.env == {**expected, **PINNED}


@pytest.mark.parametrize(
    "overrides",
    [
        ("policy=original",),  # delayed scaling's FP8 attention reads O8: no TE switch for original
        ("policy=exact",),
        ("attention.bwd_precision=fp32",),  # TE's attention backward is FP8 or BF16
        ("backend.attention_core=readback",),
    ],
)
def test_no_te_switch_means_readback_attention_core(overrides):
    plan = te_plan(config("reuse_rounded", *overrides), TE2)
    assert plan.attention_core == "readback" and plan.env == {}
    assert plan.recipe_kwargs["fp8_dpa"] is False
    assert plan.sites["attention_core"].startswith("readback.ops.attention")


def test_delayed_recipe_kwargs_come_from_the_precision_group():
    cfg = config(
        "reuse_rounded",
        "precision.margin=1",
        "precision.fp8_format=E4M3",
        "precision.amax_history_len=16",
        "precision.amax_compute_algo=most_recent",
    )
    assert te_plan(cfg, TE2).recipe_kwargs == dict(
        margin=1, fp8_format="E4M3", amax_history_len=16, amax_compute_algo="most_recent", fp8_dpa=True, fp8_mha=False
    )


def test_fp8_mha_shares_the_one_o8_and_without_it_o_is_rounded_twice():
    plan = te_plan(config("reuse_rounded", "backend.fp8_mha=true"), TE2)
    assert plan.recipe_kwargs["fp8_mha"] is True and plan.fp8_output
    assert plan.sites["attn_proj"] == "te.Linear (multiplies the core's O8: fp8_output=True)"
    plain = te_plan(config("reuse_rounded"), TE2)
    assert not plain.fp8_output and "O rounded twice" in plain.sites["attn_proj"]
    with pytest.raises(ConfigError, match=r"backend.fp8_mha"):
        te_plan(config("fresh_reround", "backend.fp8_mha=true"), TE2)


def test_te_2_15_pins_backward_override_so_the_environment_cannot_change_linear_reads():
    assert te_plan(config("reuse_rounded"), "2.15.0").recipe_kwargs["backward_override"] is None
    assert "backward_override" not in te_plan(config("reuse_rounded"), "2.14.0").recipe_kwargs
    assert te_plan(config("reuse_rounded"), TE2).sites["linear"] == (
        "te.Linear (backward reads the forward's W8 and X8: save_original_input=False, backward_override=None)"
    )


def test_a_linear_read_rule_te_has_no_switch_for_is_refused(monkeypatch):
    from readback.backends.te import linear as te_linear

    wrong = {**te_linear.LINEAR_READS, "exact": {"dgrad": "rounded", "wgrad": "original"}}
    monkeypatch.setattr(te_linear, "LINEAR_READS", wrong)  # the op's own table is read-only
    with pytest.raises(ConfigError, match=r"^policy='exact' is not valid; valid: a policy whose linears read"):
        te_plan(config("reuse_rounded", "policy=exact"), TE2)


def test_mxfp8_is_te_only_with_readback_attention_on_per_tensor_scaling():
    cfg = config("reuse_rounded", "precision.recipe=mxfp8")
    plan = te_plan(cfg, TE2, B200)
    assert plan.recipe == "MXFP8BlockScaling" and plan.recipe_kwargs == dict(fp8_format="E4M3")  # TE's default there
    recipe = te_backend.readback_numerics(cfg).recipe  # the one recipe object, read by readback's sites too
    assert plan.attention_core == "readback" and isinstance(recipe, MXFP8BlockScaling)
    assert isinstance(new_state(recipe, E4M3), CurrentScalingState)  # readback's own ops scale per tensor
    with_margin = te_plan(config("reuse_rounded", "precision.recipe=mxfp8", "precision.margin=2"), TE2)
    assert with_margin.recipe_kwargs["margin"] == 2


NVFP4_FPROP = "fprop reads X rowwise 1x16 and W 16x16"
NVFP4_RHT = "after the 16-point random Hadamard transform"


@pytest.mark.parametrize(
    "switch, dgrad, wgrad",
    [
        (
            None,
            "dgrad reads dY rowwise 1x16 (rounded stochastically) and W 16x16 (read rounded)",
            f"wgrad reads dY columnwise 16x1 ({NVFP4_RHT}, rounded stochastically again, with its own random bits) "
            f"and X columnwise 16x1 ({NVFP4_RHT}, read rotated)",
        ),
        (
            "disable_rht",
            "dgrad reads dY rowwise 1x16 (rounded stochastically) and W 16x16 (read rounded)",
            "wgrad reads dY columnwise 16x1 (rounded stochastically again, with its own random bits) "
            "and X columnwise 16x1 (read requantized)",
        ),
        (
            "disable_stochastic_rounding",
            "dgrad reads dY rowwise 1x16 and W 16x16 (read rounded)",
            f"wgrad reads dY columnwise 16x1 ({NVFP4_RHT}) and X columnwise 16x1 ({NVFP4_RHT}, read rotated)",
        ),
        (
            "disable_2d_quantization",
            "dgrad reads dY rowwise 1x16 (rounded stochastically) and W columnwise 16x1 (read requantized)",
            f"wgrad reads dY columnwise 16x1 ({NVFP4_RHT}, rounded stochastically again, with its own random bits) "
            f"and X columnwise 16x1 ({NVFP4_RHT}, read rotated)",
        ),
    ],
)
def test_nvfp4_plan_names_what_each_linear_gemm_reads(switch, dgrad, wgrad):
    """te.Linear under NVFP4BlockScaling: fprop X 1x16 and W 16x16; dgrad dY rowwise, rounded
    stochastically, and the one W copy; wgrad the columnwise copies of X and dY after the
    Hadamard transform, dY rounded stochastically again; readback's attention core (TE leaves
    attention unquantised under NVFP4). The read modes are the emulated linear's."""
    cfg = config("reuse_rounded", "precision.recipe=nvfp4", *([f"precision.{switch}=true"] if switch else []))
    plan = te_plan(cfg, "2.20.0", B200)
    fprop = "fprop reads X rowwise 1x16 and " + ("W rowwise 1x16" if switch == "disable_2d_quantization" else "W 16x16")
    assert plan.sites["linear"] == (
        f"te.Linear ({fprop}; {dgrad}; {wgrad}: save_original_input=False, backward_override=None)"
    )
    assert plan.recipe == "NVFP4BlockScaling" and plan.attention_core == "readback" and plan.env == {}
    assert "fp8_dpa" not in plan.recipe_kwargs
    reads = te_backend.readback_numerics(cfg).spec.reads["linear"]  # what the emulated linear reads
    assert f"W {'columnwise 16x1' if switch == 'disable_2d_quantization' else '16x16'} (read {reads['dgrad']})" in dgrad
    assert wgrad.endswith(f"read {reads['wgrad']})")


def test_block_recipe_plans_name_each_gemm_s_copies_and_a_backward_override_s_reads():
    mxfp8 = te_plan(config("reuse_rounded", "precision.recipe=mxfp8"), TE2, B200).sites["linear"]
    assert mxfp8.startswith("te.Linear (fprop reads X rowwise 1x32 and W rowwise 1x32; dgrad reads dY rowwise 1x32 ")
    wgrad = "wgrad reads dY columnwise 32x1 and X columnwise 32x1 (read requantized)"
    assert f"and W columnwise 32x1 (read requantized); {wgrad}:" in mxfp8
    blockwise = te_plan(config("reuse_rounded", "precision.recipe=blockwise"), TE2, H100).sites["linear"]
    assert "dgrad reads dY rowwise 1x128 and W 128x128 (read rounded); wgrad" in blockwise
    override = config("reuse_rounded", "precision.recipe=nvfp4", "precision.backward_override=dequantized")
    assert te_plan(override, "2.20.0", B200).sites["linear"] == (
        f"te.Linear ({NVFP4_FPROP}; backward reads the forward's copies of W and X dequantised, in BF16 GEMMs: "
        "save_original_input=False, backward_override=dequantized)"
    )


def test_head_dim_128_trains_fp8_attention_on_sm90_and_te_2_7_allowed_other_head_dims():
    assert te_plan(config("reuse_rounded", *HD128), TE2, H100).attention_core == "te"
    assert te_plan(config("reuse_rounded"), "2.7.0", H100).attention_core == "te"  # head dim 16, cuDNN 9.13
    assert te_plan(config("reuse_rounded"), TE2, B200).attention_core == "te"  # sm100: head dim <= 128


# --------------------------------------------------------------------------- refusals
UNKNOWN_GPU = Hardware()  # planning without the GPU: the checks that need it are not made


def _refusal(overrides, version, hardware=UNKNOWN_GPU):
    with pytest.raises(ConfigError) as error:
        te_plan(config("reuse_rounded", *overrides), version, hardware)
    message = str(error.value)
    assert "\n" not in message
    return message


# Every combination Transformer Engine cannot run, refused in one line naming the setting, the
# TE version and the GPU.
REFUSALS = [
    ((), TE2, H100, "model.n_heads=4", "FP8 attention training on sm90 needs head dim 128"),
    (
        ("model.seq_len=100", "model.d_model=512"),
        "2.7.0",
        Hardware((9, 0), (9, 5, 0)),
        "model.seq_len=100",
        "head dim 128 and sequence % 128 == 0",
    ),
    (
        ("precision.recipe=current", *HD128),
        TE2,
        H100,
        "precision.recipe='current'",
        "FP8 attention under current scaling needs sm100",
    ),
    (
        ("precision.recipe=current", *HD128),
        "2.9.0",
        Hardware((10, 0), (9, 13, 0)),
        "precision.recipe='current'",
        "needs cuDNN >= 9.14.0",
    ),
    (("precision.recipe=mxfp8",), TE2, H100, "precision.recipe='mxfp8'", "MXFP8BlockScaling needs sm100"),
    (("precision.recipe=nvfp4",), TE2, H100, "precision.recipe='nvfp4'", "NVFP4BlockScaling needs sm100 or newer"),
    (
        HD128,
        TE2,
        Hardware((8, 9), (9, 13, 0)),
        "backend.attention_core='auto'",
        "FP8 attention needs sm90 or newer (sm89 has FP8 GEMMs only)",
    ),
    ((), TE2, Hardware((8, 0), (9, 13, 0)), "precision='fp8'", "FP8 needs sm89 or newer"),
    (HD128, TE2, Hardware((9, 0), (9, 10, 0)), "backend.attention_core='auto'", "cuDNN >= 9.2.1 and not 9.10.0"),
    (HD128, TE2, Hardware((9, 0), (9, 1, 0)), "backend.attention_core='auto'", "cuDNN >= 9.2.1 and not 9.10.0"),
    (("backend.fp8_mha=true",), "2.7.0", Hardware(), "backend.fp8_mha=True", "fp8_output=True"),
    (HD128, TE2, Hardware((10, 0), (9, 5, 0)), "backend.attention_core='auto'", "on sm100 needs cuDNN >= 9.7"),
    (("model.d_model=1024", "model.n_heads=4"), TE2, B200, "model.n_heads=4", "head dim % 16 == 0, <= 128"),
]


@pytest.mark.parametrize("overrides, version, hardware, setting, reason", REFUSALS)
def test_what_te_cannot_run_on_this_gpu_is_refused_in_one_line(overrides, version, hardware, setting, reason):
    message = _refusal(overrides, version, hardware)
    assert message.startswith(setting) and reason in message
    assert f"Transformer Engine {version} on {hardware.describe()}" in message


def test_readback_attention_core_runs_where_te_attention_cannot():
    cfg = config("reuse_rounded", "precision.recipe=current", "backend.attention_core=readback")
    assert te_plan(cfg, TE2, H100).attention_core == "readback"  # sm90, head dim 16: TE's GEMMs only


@pytest.mark.parametrize(
    "version, state",
    [
        ("1.13.0", "ignores DelayedScaling.interval"),
        ("2.1.0", "ignores DelayedScaling.interval"),
        ("2.2.0", "has no DelayedScaling.interval"),
        ("2.8.0+cu12", "has no DelayedScaling.interval"),
    ],
)
def test_interval_is_refused_naming_the_te_version(version, state):
    message = _refusal(("precision.interval=4",), version)
    assert message.startswith("precision.interval=4") and f"Transformer Engine {version}" in message
    assert state in message


def test_override_linear_precision_refused_on_te2_naming_the_version():
    message = _refusal(("precision.override_linear_precision=[false,false,true]",), "2.1.0")
    assert "precision.override_linear_precision" in message
    assert "Transformer Engine 2.1.0" in message and "removed in 2.0" in message


def test_override_linear_precision_on_te1_passes_only_the_wgrad_override():
    plan = te_plan(config("reuse_rounded", "precision.override_linear_precision=[false,false,true]"), "1.13.0")
    assert plan.recipe_kwargs["override_linear_precision"] == (False, False, True)
    with pytest.raises(ConfigError, match=r"Transformer Engine 1.13.0 .* overrides only the wgrad"):
        te_plan(config("reuse_rounded", "precision.override_linear_precision=[true,false,false]"), "1.13.0")


def test_defaults_of_removed_fields_are_accepted_and_not_passed():
    kwargs = te_plan(config("reuse_rounded"), "2.1.0").recipe_kwargs
    assert "interval" not in kwargs and "override_linear_precision" not in kwargs


def test_unknown_te_version_is_named_as_not_installed():
    with pytest.raises(ConfigError, match=r"Transformer Engine \(not installed here"):
        te_plan(config("reuse_rounded", "precision.interval=2"), None)


@pytest.mark.parametrize(
    "overrides, key, version",
    [
        (("precision.recipe=current", "precision.margin=1"), "precision.margin", TE2),
        (("precision.rounding=stochastic",), "precision.rounding", TE2),
        (("precision.recipe=current",), "precision.recipe", "2.1.0"),  # no Float8CurrentScaling yet
        (("precision.recipe=current",), "precision.recipe", "2.5.0"),  # no FP8 attention under current scaling
        (("precision.recipe=mxfp8",), "precision.recipe", "1.13.0"),
        (("precision.recipe=nvfp4",), "precision.recipe", "2.7.0"),  # no NVFP4BlockScaling yet
        (("precision.recipe=nvfp4", "backend.fp8_mha=true"), "backend.fp8_mha", TE2),  # readback's attention
        ((), "backend", "1.11.0"),
        (("backend.attention_core=bogus",), "backend.attention_core", TE2),
    ],
)
def test_what_te_cannot_run_is_refused_in_one_line(overrides, key, version):
    assert _refusal(overrides, version).startswith(f"{key}=")


def test_current_scaling_on_older_te_runs_with_readback_attention():
    plan = te_plan(config("reuse_rounded", "precision.recipe=current", "backend.attention_core=readback"), "2.5.0")
    assert plan.recipe == "Float8CurrentScaling" and plan.attention_core == "readback"


def test_cudnn_version_decoding():
    assert cudnn_version(91002) == (9, 10, 2) and cudnn_version(90201) == (9, 2, 1)
    assert cudnn_version(8906) == (8, 9, 6) and cudnn_version(None) is None


# --------------------------------------------------------------------------- helpers and availability


def test_version_tuple():
    assert version_tuple("2.8.0+cu12") == (2, 8, 0) and version_tuple("1.13") == (1, 13, 0)
    assert version_tuple("2.9.0.dev0+abc") == (2, 9, 0) and version_tuple(None) is None


def test_mapping_never_imports_transformer_engine():
    before = "transformer_engine" in sys.modules
    te_plan(config("reuse_rounded"))
    backends.site_implementations(config("reuse_rounded"))
    assert ("transformer_engine" in sys.modules) == before


def test_site_implementations_for_both_backends():
    emulated = backends.site_implementations(config("reuse_rounded", backend="emulated"))
    assert emulated["attention_core"] == "readback.ops.attention" and emulated["linear"] == "readback.ops.linear"
    assert emulated["lm_head"] == "readback.ops.linear (tied embedding) in BF16"
    assert (emulated["attention_core.D"], emulated["attention_core.dK"]) == ("rounded O", "rounded Q")
    assert emulated["linear.accumulation"] == "fprop=native dgrad=native wgrad=native"
    hopper = backends.site_implementations(config("reuse_rounded", "precision.accumulation=hopper", backend="emulated"))
    assert hopper["linear.accumulation"] == "fprop=fast dgrad=split wgrad=split"
    assert hopper["attention_core.accumulation"] == "ieee"
    te = backends.site_implementations(config("reuse_rounded"))
    assert te == te_plan(config("reuse_rounded")).sites and set(te) == set(emulated)
    assert te["linear.accumulation"] == hopper["linear.accumulation"]


@pytest.mark.skipif(HAS_TE, reason="this machine has CUDA and transformer_engine")
def test_check_available_refuses_in_one_line_without_cuda_or_te():
    expected = (
        "backend='te' is not valid; valid: needs CUDA and transformer_engine (container/, or pip install "
        "--no-build-isolation -e .[gpu]); "
        "use backend=emulated on this machine"
    )
    with pytest.raises(ConfigError) as error:
        te_backend.check_available()
    assert str(error.value) == expected
    with pytest.raises(ConfigError):
        backends.check_available(config("reuse_rounded"))
    with pytest.raises(ConfigError) as error:
        te_backend.build_te_model(config("reuse_rounded", "model.vocab_size=256"), "cuda")
    assert str(error.value) == expected


def test_emulated_backend_is_always_available():
    backends.check_available(config("reuse_rounded", backend="emulated"))


def test_apply_te_env_sets_variables_and_guards_import_time_ones(monkeypatch):
    monkeypatch.delenv("NVTE_FP8_DPA_BWD", raising=False)
    monkeypatch.delenv("NVTE_DPA_FP8CS_O_in_F16", raising=False)
    monkeypatch.delitem(sys.modules, "transformer_engine", raising=False)
    te_backend.apply_te_env({"NVTE_FP8_DPA_BWD": "0"})
    assert te_backend.os.environ["NVTE_FP8_DPA_BWD"] == "0"
    monkeypatch.setitem(sys.modules, "transformer_engine", types.ModuleType("transformer_engine"))
    te_backend.apply_te_env({"NVTE_FP8_DPA_BWD": "1", "NVTE_DPA_FP8CS_O_in_F16": "1"})  # TE's default: no change
    with pytest.raises(ConfigError, match="fresh process"):
        te_backend.apply_te_env({"NVTE_DPA_FP8CS_O_in_F16": "0"})


def test_meta_build_needs_no_te_and_has_the_shapes():
    from readback.backends import build_model

    cfg = config("reuse_rounded", "model.vocab_size=256")
    meta = build_model(cfg, "meta")
    emulated = build_model(config("reuse_rounded", "model.vocab_size=256", backend="emulated"), "meta")
    assert meta.n_params() == emulated.n_params() and meta.flops_per_token() == emulated.flops_per_token()


# --------------------------------------------------------------------------- wiring on a stand-in TE
# A few lines of PyTorch with the call signatures of the Transformer Engine modules the backend
# uses. It checks this backend's own wiring (shapes, names, interface) on a CPU; it says nothing
# about Transformer Engine's numerics, which the tests below check on a GPU.


def _stand_in_te():
    class Linear(nn.Linear):
        def __init__(self, d_in, d_out, bias=True, device=None):
            super().__init__(d_in, d_out, bias=bias, device=device)

    class RMSNorm(nn.Module):
        def __init__(self, dim, eps=1e-5, device=None):
            super().__init__()
            self.weight, self.eps = nn.Parameter(torch.ones(dim, device=device)), eps

        def forward(self, x):
            return F.rms_norm(x, x.shape[-1:], self.weight.to(x.dtype), self.eps)

    class DotProductAttention(nn.Module):
        def __init__(
            self,
            heads,
            kv_channels,
            num_gqa_groups=None,
            attention_dropout=0.0,
            attn_mask_type="causal",
            qkv_format="sbhd",
            softmax_scale=None,
            layer_number=None,
        ):
            super().__init__()
            assert qkv_format == "bshd" and attn_mask_type == "causal"
            self.scale = softmax_scale

        def forward(self, q, k, v, fp8_output=False):
            assert q.dtype == torch.bfloat16 and q.is_contiguous() and q.shape[1] == 16  # bshd
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=True)
            return o.transpose(1, 2).flatten(2)

    @dataclass
    class DelayedScaling:
        margin: int = 0
        fp8_format: object = None
        amax_history_len: int = 1024
        amax_compute_algo: str = "max"
        fp8_dpa: bool = False
        fp8_mha: bool = False

    calls = []
    pytorch = types.SimpleNamespace(
        Linear=Linear,
        RMSNorm=RMSNorm,
        DotProductAttention=DotProductAttention,
        autocast=lambda enabled=True, recipe=None, amax_reduction_group=None: (
            calls.append((enabled, recipe)) or nullcontext()
        ),
    )
    recipe = types.SimpleNamespace(
        DelayedScaling=DelayedScaling, Format=types.SimpleNamespace(HYBRID="HYBRID", E4M3="E4M3")
    )
    return (pytorch, recipe), calls


@pytest.fixture
def stand_in(monkeypatch):
    modules, calls = _stand_in_te()
    monkeypatch.setattr(te_backend, "_TE", modules)
    return calls


def _stand_in_model(cfg):
    from readback.model import FOG, fog_config

    plan = te_plan(cfg, TE2)
    numerics = te_backend.readback_numerics(cfg)
    torch.manual_seed(0)
    return FOG(fog_config(cfg.model), numerics, te_backend.TEParts(numerics, plan, "cpu"))


@pytest.mark.parametrize("experiment", ["reuse_rounded", "fresh_reround", "bf16_baseline"])
def test_te_model_interface_on_stand_in(stand_in, experiment):
    from readback.backends import build_model

    cfg = config(experiment, "model.vocab_size=64", "model.seq_len=16")
    model = _stand_in_model(cfg)
    emulated = build_model(config(experiment, "model.vocab_size=64", "model.seq_len=16", backend="emulated"))
    assert model.n_params() == emulated.n_params()
    assert model.flops_per_token() == emulated.flops_per_token()
    idx = torch.randint(0, 64, (2, 16))
    stats = ActivationStats(model)
    stats.active = True
    loss = model(idx, idx.roll(-1, 1))
    assert loss.dtype == torch.float32 and math.isfinite(loss.item()) and abs(loss.item() - math.log(64)) < 1.0
    loss.backward()
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in trainable)
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)  # frozen QK-norm gains
    assert set(stats.pop()) == {"kurtosis/attn_out_max", "kurtosis/ffn_in_max"}
    plan = model.parts.plan
    readback_core = plan.attention_core == "readback"
    core, proj = model.layers[0].attn.core, model.layers[0].attn.proj
    assert isinstance(core, AttentionCore) == readback_core
    assert isinstance(proj, ReadbackLinear) == readback_core and isinstance(proj, nn.Linear) != readback_core
    assert stand_in == ([(True, model.parts.recipe)] if plan.fp8 else [])
    numerics = model.numerics
    if readback_core:
        assert any(k.startswith("attn_rowsum/mean/layers.0.attn.core") for k in numerics.pop_observations())
        assert "layers.0.attn.core.output" in numerics.sites  # readback's sites, in model.numerics
    numerics.end_step()
    state = numerics.state_dict()
    assert state["step"] == 1
    numerics.load_state_dict(state)
    assert isinstance(numerics.saturation_counts(), dict)


def test_fp8_lm_head_and_bf16_layers_on_stand_in(stand_in):
    cfg = config("reuse_rounded", "model.vocab_size=64", "model.seq_len=16", "precision.bf16_layers=[layers.0.mlp]")
    model = _stand_in_model(cfg)
    assert model.parts.plan.sites["lm_head"] == "readback.ops.linear (tied embedding)"
    assert model.layers[0].mlp.up.readback_fp8_off and not model.layers[1].mlp.up.readback_fp8_off
    idx = torch.randint(0, 64, (2, 16))
    model(idx, idx).backward()
    assert (False, None) in stand_in  # FP8 switched off around layers.0.mlp's GEMMs
    assert "lm_head.input" in model.numerics.sites  # the tied FP8 head rounds through readback's linear


def test_forward_reasserts_its_runtime_switches_on_stand_in(stand_in, monkeypatch):
    model = _stand_in_model(config("reuse_rounded_bf16_bwd", "model.vocab_size=64", "model.seq_len=16"))
    monkeypatch.setenv("NVTE_FP8_DPA_BWD", "1")  # as another model built later in this process would
    idx = torch.randint(0, 64, (2, 16))
    model(idx, idx)
    assert te_backend.os.environ["NVTE_FP8_DPA_BWD"] == "0"


# --------------------------------------------------------------------------- the real thing (GPU)

# Head dim 128: TE's FP8 attention trains no other head dim on sm90 (backends.te.facts.fp8_attention_refusal).
GPU_MODEL = (
    "model.vocab_size=512",
    "model.d_model=256",
    "model.n_heads=2",
    "model.n_kv_groups=1",
    "model.ffn_dim=384",
    "model.seq_len=128",
)


@needs_te
@pytest.mark.gpu
@pytest.mark.parametrize(
    "experiment", ["reuse_rounded", "reuse_rounded_bf16_bwd", "fresh_reround", "no_saved_copy", "bf16_baseline"]
)
def test_te_model_trains_a_step(experiment):
    import transformer_engine.pytorch as te

    cfg = config(experiment, *GPU_MODEL)
    torch.manual_seed(0)
    model = te_backend.build_te_model(cfg, "cuda")
    plan = model.parts.plan
    assert model.cfg.head_dim == 128
    for key, value in plan.env.items():
        assert te_backend.os.environ[key] == value
    core = model.layers[0].attn.core
    assert isinstance(core, te.DotProductAttention) if plan.te_attention else isinstance(core, AttentionCore)
    assert isinstance(model.layers[0].mlp.up, te.Linear) and isinstance(model.layers[0].attn_norm, te.RMSNorm)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    idx = torch.randint(0, 512, (2, 128), device="cuda")
    losses = []
    for _ in range(3):
        loss = model(idx, idx.roll(-1, 1))
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        model.numerics.end_step()
        losses.append(loss.item())
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    if plan.fp8:
        assert any(k.endswith("_extra_state") for k in model.state_dict())  # TE's FP8 scaling state


@needs_te
@pytest.mark.gpu
@pytest.mark.parametrize("experiment", ["reuse_rounded", "no_saved_copy", "bf16_baseline"])
def test_te_model_matches_emulated_loss_with_the_same_weights(experiment):
    from readback.backends import build_model

    torch.manual_seed(0)
    emulated = build_model(config(experiment, *GPU_MODEL, backend="emulated"), "cuda")
    model = te_backend.build_te_model(config(experiment, *GPU_MODEL), "cuda")
    weights = {k.replace("norm.gain", "norm.weight"): v for k, v in emulated.state_dict().items()}
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and all("q_norm" in k or "k_norm" in k or "_extra_state" in k for k in missing)
    idx = torch.randint(0, 512, (2, 128), device="cuda")
    with torch.no_grad():
        te_loss, emulated_loss = model(idx, idx.roll(-1, 1)).item(), emulated(idx, idx.roll(-1, 1)).item()
    assert abs(te_loss - emulated_loss) < 0.05 * emulated_loss


def test_documented_te_table_is_the_plan():

    from readback.backends.te import table as te_table

    def compose_te(overrides):
        return typed_config(*overrides)

    text = (REPO / "docs/te_backend.md").read_text()
    documented = text.split(te_table.START, 1)[1].split(te_table.END, 1)[0].strip()
    assert documented == te_table.render(compose_te), "regenerate with: python -m readback.cli.te_table"
