"""``python -m readback.cli.bias`` with a stress given at measurement time: ``--site-margin`` replaces
the checkpoint's own margins, refuses what matches no site, and ``--sweep-margin`` writes the
dose and response of a 2-step run's checkpoint."""

from __future__ import annotations

import io
import json
import logging
import math
import shutil
import subprocess
import sys

import pytest
import torch

from readback.bias.dose import D_READ, plot_dose, rows_of
from readback.cli.bias import load_run
from readback.cli.bias import main as bias_main
from readback.cli.bias_shapes import main as shapes_main
from readback.errors import ConfigError
from readback.numerics import CurrentScalingState, DelayedScalingState
from readback.train.records.identity import cpu_kind
from toys import REPO, TWO_STEP_RUN

OWN_MARGIN = 4  # the run's own precision.site_margin at attn.core.output
LAYERS = ("layers.0.attn", "layers.1.attn")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 2-step, 2-layer reuse_rounded run under delayed scaling (a constant O8 scale within a
    measurement), with a checkpoint at step 2."""
    run = tmp_path_factory.mktemp("dose") / "run"
    overrides = [o for o in TWO_STEP_RUN if not o.startswith("model.n_layers=")]
    subprocess.run(
        [
            sys.executable,
            "train.py",
            *overrides,
            "model.n_layers=2",
            "trainer.ckpt_every=2",
            "+experiment=reuse_rounded",
            f"precision.site_margin={{attn.core.output:{OWN_MARGIN}}}",
            f"hydra.run.dir={run}",
        ],
        cwd=REPO,
        check=True,
        capture_output=True,
        timeout=300,
    )
    return run


def _o_rounding(run, out, *flags):
    assert bias_main([str(run), "--batches", "1", "--out", str(out), *flags]) == 0
    return json.loads((out / "bias.json").read_text())


@pytest.mark.slow
def test_a_site_margin_given_at_measurement_replaces_the_runs_own(run, tmp_path):
    model, *_ = load_run(run)
    recipe_log2 = {
        layer: math.log2(float(model.numerics.sites[f"{layer}.core.output"].state.scale)) for layer in LAYERS
    }

    def shifts(written: dict) -> dict[str, float]:
        """log2 of each layer's O8 scale in the meter's forward, relative to the recipe's scale."""
        return {layer: written["o_rounding"][layer]["log2_scale"] - recipe_log2[layer] for layer in LAYERS}

    own = _o_rounding(run, tmp_path / "own")
    assert own["site_margin"] == {"attn.core.output": OWN_MARGIN} and own["site_margin_from"] == "checkpoint"
    assert shifts(own) == pytest.approx(dict.fromkeys(LAYERS, -OWN_MARGIN), abs=1e-12)
    given = _o_rounding(run, tmp_path / "six", "--site-margin", "attn.core.output=6")
    assert given["site_margin"] == {"attn.core.output": 6} and given["site_margin_from"] == "command line"
    assert shifts(given) == pytest.approx(dict.fromkeys(LAYERS, -6), abs=1e-12)  # 6, not 4 + 6
    none = _o_rounding(run, tmp_path / "zero", "--site-margin", "attn.core.output=0")
    assert shifts(none) == pytest.approx(dict.fromkeys(LAYERS, 0), abs=1e-12)
    assert [none["o_rounding"][layer]["margin"] for layer in LAYERS] == [0, 0]
    first = "layers.0.attn"  # its O is the same forward's (later layers see the changed O8)
    rms_shift = given["o_rounding"][first]["log2_rms_scaled"] - none["o_rounding"][first]["log2_rms_scaled"]
    assert rms_shift == pytest.approx(-6, abs=1e-9)  # 6 binades lower on the grid
    twice = _o_rounding(
        run, tmp_path / "twice", "--site-margin", "attn.core.output=3", "--site-margin", "attn.core.output=6"
    )
    assert shifts(twice) == pytest.approx(dict.fromkeys(LAYERS, -6), abs=1e-12)  # the last K of a pattern
    overlapping = _o_rounding(
        run, tmp_path / "both", "--site-margin", "attn.core.output=3", "--site-margin", "layers.0.attn.core.output=2"
    )
    assert shifts(overlapping) == pytest.approx({"layers.0.attn": -5, "layers.1.attn": -3}, abs=1e-12)  # they add
    assert bias_main([str(run), "--batches", "1", "--site-margin", "attn.core.output=6"]) == 0
    assert json.loads((run / "bias" / "step2-attn.core.output=6" / "bias.json").read_text()) == {
        **given,
        "seconds_per_batch": pytest.approx(given["seconds_per_batch"], rel=10),
        "steps_per_batch": pytest.approx(given["steps_per_batch"], rel=10),
    }  # the default directory is named by the margins; the same measurement


@pytest.mark.slow
@pytest.mark.parametrize(
    ("flag", "words"),
    [
        ("attn.nothing=3", "'attn.nothing' is not valid; valid: site patterns (globs) matching"),
        ("attn.core.output=-1", "is not valid; valid: an integer >= 0"),
        ("attn.core.output", "valid: PATTERN=K"),
    ],
)
def test_a_refused_margin_is_one_line_and_exit_2(run, tmp_path, capsys, flag, words):
    sweep = flag.replace("=", "=0,") if "=" in flag else flag  # a sweep refuses before its first K runs
    for option, value in (("--site-margin", flag), ("--sweep-margin", sweep)):
        with pytest.raises(SystemExit) as exit_:
            bias_main([str(run), "--batches", "1", "--out", str(tmp_path), option, value])
        assert exit_.value.code == 2
        error = capsys.readouterr().err
        assert words in error and error.count("\n") == 1, option
        assert not list(tmp_path.iterdir()), option


@pytest.mark.slow
def test_the_dose_and_response_of_a_checkpoint(run, tmp_path):
    assert (
        bias_main([str(run), "--batches", "2", "--sweep-margin", "attn.core.output=0,12", "--out", str(tmp_path)]) == 0
    )
    for k in (0, 12):
        assert json.loads((tmp_path / f"margin{k}" / "bias.json").read_text())["site_margin"] == {"attn.core.output": k}
    dose = json.loads((tmp_path / "dose.json").read_text())
    assert dose["margins"] == [0, 12] and dose["batches"] == 2 and dose["checkpoint_step"] == 2
    assert (tmp_path / "dose.png").stat().st_size > 0
    rows = rows_of(dose)
    assert rows == [("total", None), ("layers.0.attn.qkv", "layers.0.attn"), ("layers.1.attn.qkv", "layers.1.attn")]
    for point in dose["points"]:
        for group, _ in rows:
            stats = point["stats"][D_READ][group]
            for stat in ("bias", "floor", "projection", "projection_se", "debiased_sq"):
                assert math.isfinite(stats[stat]), (point["margin"], group, stat)
            assert stats["debiased_sq_se"] is None  # needs 4 batches
        for layer in LAYERS:
            assert all(
                math.isfinite(point["o_rounding"][layer][key]) for key in ("underflow", "rel_err", "amax_to_rms")
            )
    calm, stressed = (point["o_rounding"] for point in dose["points"])
    for layer in LAYERS:
        assert calm[layer]["underflow"] < stressed[layer]["underflow"]
        assert calm[layer]["rel_err"] < stressed[layer]["rel_err"]
    plot_dose(dose).savefig(io.BytesIO(), format="png")  # the JSON's nulls draw too


@pytest.mark.slow
def test_the_shape_table_reads_the_meters_own_output(run, tmp_path):
    """``readback.bias.shapes`` on a real measurement: the run's shape from its config, the D
    read's figures from its bias.json (sqrt of the debiased square), O's from its o_rounding."""
    measured = shutil.copytree(run, tmp_path / "sweep" / "run")
    assert bias_main([str(measured), "--batches", "4", "--out", str(measured / "bias" / "width")]) == 0
    bias = json.loads((measured / "bias" / "width" / "bias.json").read_text())
    assert shapes_main([str(tmp_path / "sweep"), "--out", str(tmp_path / "out")]) == 0
    rows = json.loads((tmp_path / "out" / "shapes.json").read_text())["rows"]
    assert [r["layer"] for r in rows] == list(LAYERS)
    for row in rows:
        s, o = bias["stats"][D_READ][row["layer"] + ".qkv"], bias["o_rounding"][row["layer"]]
        assert (row["head_dim"], row["seq_len"], row["seeds"]) == (16, 32, [0])
        assert row["share"] == math.sqrt(max(s["debiased_sq"], 0.0)) and row["projection"] == s["projection"]
        assert row["rel_err"] == o["rel_err"] and row["underflow"] == o["underflow"]
        assert math.isfinite(row["rowsum_z"])


@pytest.mark.slow
def test_the_accumulation_given_at_measurement_replaces_the_runs_own(run, tmp_path, capsys):
    """``--accumulation hopper`` measures the run's checkpoint with Hopper's accumulation (fast
    forward, split backward) and attributes each backward GEMM kind; ``--accumulation-gemm``
    overrides one; a name the config refuses is one line and exit 2."""
    assert bias_main([str(run), "--batches", "1", "--accumulation", "hopper"]) == 0
    hopper = json.loads((run / "bias" / "step2-acc-hopper" / "bias.json").read_text())
    assert hopper["accumulation"] == ["fast", "split", "split"]
    assert {"contrib.ieee_acc.dgrad", "contrib.ieee_acc.wgrad"} <= set(hopper["stats"])
    assert hopper["gemm_k"]["layers.0.mlp.down"]["wgrad"] > 0
    mixed = _o_rounding(run, tmp_path / "mixed", "--accumulation", "hopper", "--accumulation-gemm", "dgrad=ieee")
    assert mixed["accumulation"] == ["fast", "ieee", "split"]
    assert "contrib.ieee_acc.dgrad" not in mixed["stats"] and "contrib.ieee_acc.wgrad" in mixed["stats"]
    own = _o_rounding(run, tmp_path / "own")
    assert own["accumulation"] == ["native"] * 3 and not [v for v in own["variants"] if "ieee_acc" in v["name"]]
    for flags, words in (
        (["--accumulation", "fast"], "precision.accumulation"),
        (["--accumulation-gemm", "dgrad"], "GEMM=MODE"),
        (["--accumulation-gemm", "attn=fast"], "accumulation_gemms"),
    ):
        with pytest.raises(SystemExit) as exit_:
            bias_main([str(run), "--batches", "1", "--out", str(tmp_path / "refused"), *flags])
        error = capsys.readouterr().err
        assert exit_.value.code == 2 and words in error and error.count("\n") == 1, flags
        assert not (tmp_path / "refused").exists()


def test_a_damaged_newest_checkpoint_is_skipped_and_left_where_it_is(run, tmp_path, capsys, caplog):
    """The meter verifies a checkpoint as a resume does; a reader leaves the run's files alone."""
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    newer = copy / "checkpoints" / "step_0000004"
    shutil.copytree(copy / "checkpoints" / "step_0000002", newer)
    shard = newer / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    with caplog.at_level(logging.WARNING):
        load_run(copy)  # step 2's: the truncated shard of step 4 would not load
    assert f"skipping damaged checkpoint {newer}" in caplog.text and "its index needs" in caplog.text
    assert newer.is_dir() and not list((copy / "checkpoints").glob("*.damaged*"))
    with pytest.raises(SystemExit) as exit_:
        bias_main([str(newer), "--batches", "1", "--out", str(tmp_path / "out")])
    error = capsys.readouterr().err
    assert exit_.value.code == 2 and "its index needs" in error and error.count("\n") == 1


@pytest.mark.slow
def test_a_recipe_given_at_measurement_meters_the_weights_under_it(run, tmp_path, capsys):
    """``--precision recipe=nvfp4`` meters the same weights under NVFP4 (its own E4M3 format, fresh
    block scales): the linears' Hadamard-rotated wgrad read is a variant and the D read is still
    metered; the checkpoint's own recipe keeps its amax history; back to delayed from another
    recipe is refused."""
    model, *_ = load_run(run, precision={"recipe": "nvfp4"})
    assert model.numerics.recipe.KEY == "nvfp4" and model.numerics.spec.reads["linear"]["wgrad"] == "rotated"
    delayed, *_ = load_run(run)
    assert delayed.numerics.sites["layers.0.attn.core.output"].state.steps == 2  # the run's amax history
    written = _o_rounding(run, tmp_path / "nvfp4", "--precision", "recipe=nvfp4")
    assert written["precision_from_command_line"] == {"recipe": "nvfp4"}
    assert set(written["code"]) == {"commit", "dirty"}  # the code version that metered it
    assert written["cpu"] == cpu_kind()  # and the CPU kind, whose bits it has
    assert "contrib.exact_read.linear.wgrad" in written["stats"] and D_READ in written["stats"]
    assert bias_main([str(run), "--batches", "1", "--precision", "recipe=nvfp4"]) == 0
    assert (run / "bias" / "step2-precision-recipe=nvfp4" / "bias.json").exists()
    with pytest.raises(SystemExit) as refused:
        bias_main([str(run), "--batches", "1", "--precision", "recipe=current", "--precision", "margin=bad"])
    assert refused.value.code == 2 and "precision.margin='bad'" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"attention.recipe='delayed'.*no amax history"):
        load_run(run, precision={"recipe": "nvfp4"}, attention={"recipe": "delayed"})


@pytest.mark.slow
def test_a_part_of_the_attention_backward_set_apart_at_measurement(run, capsys):
    """``--attention round_grad_output=false`` meters the checkpoint under the FP8 backward with dO
    left unrounded: the meter's backward rounds no dO, its history of O is the run's, and the
    default directory names the replaced key; a bad value is refused in one line."""
    model, *_ = load_run(run, attention={"round_grad_output": False})
    assert not model.numerics.spec.attention_rounds("grad_output") and model.numerics.spec.attention_rounds(
        "grad_scores"
    )
    assert model.numerics.sites["layers.0.attn.core.output"].state.steps == 2  # the run's own scaling states
    assert bias_main([str(run), "--batches", "1", "--attention", "round_grad_output=false"]) == 0
    written = json.loads((run / "bias" / "step2-attention-round_grad_output=false" / "bias.json").read_text())
    assert written["attention_from_command_line"] == {"round_grad_output": False}
    with pytest.raises(SystemExit) as refused:
        bias_main([str(run), "--batches", "1", "--attention", "bwd_qkv=q8"])
    assert refused.value.code == 2 and "attention.bwd_qkv='q8'" in capsys.readouterr().err


@pytest.mark.slow
def test_the_parts_meter_at_a_longer_sequence(run, capsys):
    """``--parts fp8-grad_scores --seq-len 32`` meters the 16-token run at 32 tokens under the two
    ends and the one backward named: the reuse effect under each and the part's interaction, in a
    directory named for both; a backward that is not one is refused in one line."""
    _, stream, *_ = load_run(run, seq_len=32)
    assert next(iter(stream.val_batches(1)))[0].shape[-1] == 32
    assert bias_main([str(run), "--batches", "4", "--parts", "fp8-grad_scores", "--seq-len", "32"]) == 0
    written = json.loads((run / "bias" / "step2-parts-T32" / "bias.json").read_text())
    assert written["seq_len_from_command_line"] == 32
    assert [v["name"] for v in written["variants"]][-3:] == [
        "reuse_rounded@fp8-grad_scores",
        "fresh_reround@fp8-grad_scores",
        "no_saved_copy@fp8-grad_scores",
    ]
    interaction = written["stats"]["interaction.fp8-grad_scores"]["total"]
    assert interaction["rel_err"] > 0 and not math.isnan(interaction["debiased_sq_se"])
    with pytest.raises(SystemExit) as refused:
        bias_main([str(run), "--batches", "1", "--parts", "fp8-dO"])
    assert refused.value.code == 2 and "--parts='fp8-dO'" in capsys.readouterr().err


@pytest.mark.slow
def test_the_parts_meter_refuses_a_run_without_an_fp8_forward(tmp_path, capsys):
    """A BF16 run has no FP8 backward to take apart: ``--parts`` is refused in one line, exit 2."""
    run = tmp_path / "bf16"
    overrides = [*TWO_STEP_RUN, "trainer.ckpt_every=2", "+experiment=bf16_baseline", f"hydra.run.dir={run}"]
    subprocess.run([sys.executable, "train.py", *overrides], cwd=REPO, check=True, capture_output=True, timeout=300)
    with pytest.raises(SystemExit) as refused:
        bias_main([str(run), "--batches", "1", "--parts"])
    err = capsys.readouterr().err
    assert refused.value.code == 2 and "--parts='every backward'" in err and "not bf16" in err
    assert not (run / "bias").exists()


@pytest.mark.slow
def test_a_current_scaling_attention_metered_from_another_recipe_starts_p_and_ds_one_step_in(run):
    """Under ``--precision recipe=current`` the core's P and dS scale by TE's one-step delayed
    recipe: their history holds one step's amax (of the first validation batch), as in training,
    not an empty one (scale 1); Q's scale is its own amax's. The weights are the checkpoint's."""
    model, *_ = load_run(run, precision={"recipe": "current"})
    delayed, *_ = load_run(run)
    sites = model.numerics.sites
    for kind in ("probs", "grad_scores"):
        state = sites[f"layers.0.attn.core.{kind}"].state
        assert isinstance(state, DelayedScalingState) and state.steps == 1 and float(state.history_amax()) > 0
    assert isinstance(sites["layers.0.attn.core.q"].state, CurrentScalingState)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), delayed.parameters()))
    assert all(p.grad is None for p in model.parameters())
