"""The attribution table: contributions across checkpoints beside the D read's, sized with the
noise floor removed, and its command's refusals."""

from __future__ import annotations

import json
import math

import pytest

from readback.bias.attribution import D_READ, attribution, shares, to_markdown
from readback.cli.bias_attribution import main


def _stats(bias, floor, debiased, debiased_se):
    return {
        "bias": bias,
        "bias_se": floor,
        "floor": floor,
        "projection": 0.0,
        "projection_se": 0.01,
        "debiased_sq": debiased,
        "debiased_sq_se": debiased_se,
    }


def _bias_json(acc_debiased=1e-4, acc_se=1e-5):
    groups = {"total": None, "layers.0.attn.qkv": None, "layers.0.mlp.up": None}
    return {
        "policy": "reuse_rounded",
        "batches": 16,
        "checkpoint_step": 2000,
        "run_dir": "run",
        "site_margin": {"attn.core.output": 14},
        "accumulation": ["fast", "split", "split"],
        "gemm_k": {
            "layers.0.attn.qkv": {"fprop": 64, "dgrad": 192, "wgrad": 2048},
            "lm_head": {"fprop": 64, "dgrad": 2048, "wgrad": 2048},
        },
        "stats": {
            "reuse_rounded": dict.fromkeys(groups, _stats(0.5, 0.01, 0.25, 0.01)),
            D_READ: dict.fromkeys(groups, _stats(0.5, 0.01, 0.25, 0.01)),
            "contrib.ieee_acc.dgrad": dict.fromkeys(groups, _stats(0.012, 0.01, acc_debiased, acc_se)),
        },
    }


def test_a_share_is_the_ratio_of_debiased_norms_and_its_upper_bound_adds_two_se():
    stats = _bias_json(acc_debiased=1e-4, acc_se=1e-5)["stats"]
    got = shares(stats, D_READ, "total")
    assert got[D_READ]["share"] == pytest.approx(1.0)
    assert got["contrib.ieee_acc.dgrad"]["share"] == pytest.approx(math.sqrt(1e-4 / 0.25))
    assert got["contrib.ieee_acc.dgrad"]["share_upper"] == pytest.approx(math.sqrt(1.2e-4 / 0.25))
    below_floor = shares(_bias_json(acc_debiased=-3e-5, acc_se=1e-5)["stats"], D_READ, "total")
    assert below_floor["contrib.ieee_acc.dgrad"]["share"] == 0.0
    assert below_floor["contrib.ieee_acc.dgrad"]["share_upper"] == 0.0  # -3e-5 + 2e-5 < 0


def test_the_table_keeps_the_chosen_groups_and_each_gemm_kinds_ks():
    table = attribution({"stress-14": _bias_json()}, ["total", "*.attn.qkv"])
    entry = table["stress-14"]
    assert list(entry["stats"]) == [D_READ, "contrib.ieee_acc.dgrad"]  # contributions only
    assert list(entry["stats"][D_READ]) == ["total", "layers.0.attn.qkv"]
    assert entry["gemm_k"] == {"fprop": [64], "dgrad": [192, 2048], "wgrad": [2048]}
    only = attribution({"stress-14": _bias_json()}, ["total"], contributions=("ieee_acc.*",))["stress-14"]
    assert list(only["stats"]) == ["contrib.ieee_acc.dgrad"]
    assert only["stats"]["contrib.ieee_acc.dgrad"]["total"]["share"] > 0  # still against the reference left out
    text = to_markdown(table)
    assert "| stress-14 | ieee_acc.dgrad | layers.0.attn.qkv |" in text and "| 64 | 192, 2048 | 2048 |" in text


def test_the_command_writes_its_files_and_refuses_a_missing_one(tmp_path, capsys):
    path = tmp_path / "bias.json"
    path.write_text(json.dumps(_bias_json()))
    assert main([f"a={path}", "--out", str(tmp_path / "out")]) == 0
    written = json.loads((tmp_path / "out" / "attribution.json").read_text())
    assert written["a"]["stats"]["contrib.ieee_acc.dgrad"]["total"]["share"] == pytest.approx(0.02)
    assert (tmp_path / "out" / "attribution.png").stat().st_size > 0
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        main([f"a={tmp_path / 'missing.json'}", "--out", str(tmp_path / "out2")])
    error = capsys.readouterr().err
    assert exit_.value.code == 2 and error.count("\n") == 1 and "LABEL=BIAS_JSON" in error
