"""scripts/meter_null_calibration.py: the summaries and calls it reports, on inputs whose answer
is known, and its decision rerun from gzipped records as they are committed."""

from __future__ import annotations

import gzip
import json
import math

import numpy as np
import pytest
import torch

import meter_null_calibration as calibration


def test_z_of_a_known_mean_is_taken_against_its_truth():
    line = {
        "alpha": 0.5,
        "known": {"projection": 0.7, "projection_se": 0.1, "debiased_sq": 0.35, "debiased_sq_se": 0.05},
    }
    assert calibration.z_scores(line, "projection", "known") == pytest.approx(2.0)
    assert calibration.z_scores(line, "debiased_sq", "known") == pytest.approx(2.0)  # truth alpha**2 = 0.25


def test_summary_of_standard_normal_draws_and_its_intervals():
    z = np.random.default_rng(0).standard_normal(4000)
    s = calibration.summary(z)
    assert s["count"] == 4000 and s["mean_ci"][0] < 0 < s["mean_ci"][1]
    assert s["sd_ci"][0] < 1 < s["sd_ci"][1] and s["share_ci"][0] < 0.0455 < s["share_ci"][1]
    none = calibration.summary(np.zeros(40) + np.linspace(-1, 1, 40))  # no |z| > 2 in 40
    assert none["share_gt2"] == 0 and none["share_ci"][1] == pytest.approx(0.0876, abs=2e-4)  # Wilson, 40


@pytest.mark.parametrize(
    ("sd", "share", "mean", "words"),
    [
        (1.0, 0.04, 0.0, "calibrated"),
        (0.7, 0.0, 0.0, "conservative"),
        (1.4, 0.04, 0.0, "anti-conservative"),
        (1.0, 0.12, 0.0, "anti-conservative"),
        (1.0, 0.04, 0.4, "biased"),
    ],
)
def test_the_preregistered_words(sd, share, mean, words):
    s = {"mean": mean, "mean_ci": [mean - 0.1, mean + 0.1], "sd": sd, "sd_ci": [sd - 0.05, sd + 0.05]}
    s |= {"share_gt2": share, "share_ci": [share - 0.01, share + 0.01]}
    assert calibration.call(s) == words


def test_decide_reruns_from_gzipped_records(tmp_path, monkeypatch):
    monkeypatch.setattr(calibration, "SYNTHETIC_REPS", 40)
    monkeypatch.setattr(calibration, "SYNTHETIC_D", 64)
    calibration.synthetic(tmp_path)
    real = []
    gen = torch.Generator().manual_seed(1)
    for n in calibration.SIZES:
        for s in range(3):
            for group in calibration.GROUPS:
                e = torch.randn(n, 32, generator=gen, dtype=torch.float64)
                r = torch.ones(n, 32, dtype=torch.float64)
                real.append({"n": n, "set": s, "group": group, **calibration._null_and_known(e, r)})
    for name, lines in (("real", real), ("synthetic", None)):
        plain = tmp_path / f"{name}.jsonl"
        text = "".join(json.dumps(x) + "\n" for x in lines) if lines else plain.read_text()
        (tmp_path / f"{name}.jsonl.gz").write_bytes(gzip.compress(text.encode()))
        plain.unlink(missing_ok=True)
    calibration.decide(tmp_path)
    rows = json.loads((tmp_path / "calibration.json").read_text())
    assert {r["source"] for r in rows} == {f"{a} {b}" for a in ("real", "gaussian", "t3") for b in ("null", "known")}
    assert all(r["call"] in ("calibrated", "conservative", "anti-conservative", "biased") for r in rows)
    gauss = [r for r in rows if r["source"] == "gaussian null" and r["stat"] == "projection"]
    assert all(math.isfinite(r["sd"]) and r["count"] == 40 for r in gauss)
    assert (tmp_path / "z_real_n16.png").stat().st_size > 0 and "Pre-registered" in (
        tmp_path / "calibration.md"
    ).read_text()
