"""readback.analysis.decisions.parts_ladder: the pre-registered calls on meter records built to cross each line."""

from __future__ import annotations

import json

import pytest

from readback.analysis.decisions.parts_ladder import PARTS, decide, detected, grows, report


def _stats(debiased: float = 0.0, se: float = 1.0, projection: float = 0.0) -> dict:
    return {
        "debiased_sq": debiased,
        "debiased_sq_se": se,
        "projection": projection,
        "projection_se": 1.0,
        "floor": 0.1,
        "rel_err_max": 0.2,
    }


def _cell(root, checkpoint, t, rounding, label, contrasts: dict) -> None:
    """A ``bias.json`` whose contrasts are at zero but for ``contrasts`` ({name: stats})."""
    names = [f"{p}@{b}" for p in ("reuse_vs_fresh", "reuse_vs_control") for b in ("fp8", "bf16")]
    names += [f"interaction.{end}{part}" for end in ("fp8-", "bf16+") for part in PARTS]
    stats = {n: {"total": contrasts.get(n, _stats())} for n in names}
    stats["reuse_rounded@fp8"] = {"total": _stats(100.0)}  # a variant, not a contrast: never read
    out = root / checkpoint / "bias" / f"T{t}-{rounding}-{label}"
    out.mkdir(parents=True)
    (out / "bias.json").write_text(json.dumps({"batches": 8, "cpu": f"CPU of {checkpoint}, AVX512", "stats": stats}))


def test_detection_and_growth_use_three_standard_errors():
    assert detected(_stats(3.0)) and not detected(_stats(2.99)) and not detected(None)
    assert grows(_stats(5.0, 1.0), _stats(0.0, 1.0)) and not grows(_stats(4.0, 1.0), _stats(0.0, 1.0))


def test_no_reuse_effect_calls_nothing(tmp_path):
    unmeasured = {**_stats(5.0), "debiased_sq_se": None}  # fewer than 4 batches: written as null
    _cell(tmp_path, "d2", 4096, "nearest", "all", {"interaction.fp8-qkv": _stats(10.0, projection=1.0)})
    _cell(tmp_path, "d4", 4096, "nearest", "fp8_end", {"reuse_vs_fresh@fp8": unmeasured})
    decision = decide(tmp_path)
    assert decision["call"].startswith("no reuse effect") and decision["loss_test_arms"] == []
    assert "| d4 | 4096 | nearest | fp8_end | 8 | CPU of d4, AVX512 |" in report(decision)  # each cell's kind


@pytest.mark.parametrize("bf16_sign", [1.0, -1.0])
def test_a_part_is_called_from_both_ends_and_tested_only_if_it_grows(tmp_path, bf16_sign):
    reuse = {"reuse_vs_fresh@fp8": _stats(5.0)}
    _cell(
        tmp_path,
        "d2",
        4096,
        "nearest",
        "all",
        {
            **reuse,
            "reuse_vs_fresh@bf16": _stats(5.0),
            "interaction.fp8-probs": _stats(10.0, projection=0.5),
            "interaction.bf16+probs": _stats(0.0, projection=bf16_sign * 0.1),
            "interaction.fp8-qkv": _stats(20.0, projection=0.5),  # no support from the BF16 end
        },
    )
    _cell(tmp_path, "d2", 512, "nearest", "all", {"interaction.fp8-probs": _stats(1.0)})
    decision = decide(tmp_path)
    if bf16_sign > 0:
        assert decision["parts_called"] == ["probs"] and decision["call"] == "carried by probs"
        assert decision["growth"]["probs"]["with_T"] and decision["loss_test_arms"] == ["fp8-probs"]
    else:
        assert decision["parts_called"] == [] and decision["call"] == "the fix acts through none of the parts"
    row = "| d2 | 4096 | nearest | all | 8 | CPU of d2, AVX512 | interaction.fp8-probs (detected) |"
    assert row in report(decision)


def test_a_reuse_effect_that_the_bf16_end_removes_is_a_joint_cause(tmp_path):
    _cell(tmp_path, "d8", 4096, "stochastic", "fp8_end", {"reuse_vs_fresh@fp8": _stats(5.0)})
    assert decide(tmp_path)["call"].startswith("a joint cause")
