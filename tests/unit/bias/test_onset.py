"""The onset table: each run's measurements at several stresses K, K read from the meter's own
record, seeds pooled per shape and K, placed on O8's grid."""

from __future__ import annotations

import json

import pytest

from meter_records import measure, measured_run
from readback.bias.onset import measurements, onset_rows
from readback.cli.bias_onset import main


@pytest.fixture
def sweep(tmp_path):
    for seed, offset in ((0, 0.0), (1, 0.0002)):
        run = measured_run(
            tmp_path / "T128", f"h8s{seed}", heads=8, seq_len=128, seed=seed, debiased=0.008 + offset, z=-3.0
        )
        for k, debiased in ((10, 0.0), (12, 0.0004)):
            measure(run, f"bias/dose/margin{k}", margin=k, debiased=debiased + offset, log2_rms_scaled=4.0 - k)
    measured_run(tmp_path / "T512", "h1s0", heads=1, seq_len=512, seed=0, debiased=0.001, z=-1.0)  # no dose
    return tmp_path


def test_measurements_are_grouped_by_the_margin_the_meter_applied(sweep):
    found = measurements(sweep, ["bias/dose/margin*", "bias/width"])
    assert list(found) == [10, 12, 14]
    assert sorted(m for _, m in found[10]) == ["bias/dose/margin10"] * 2
    assert len(found[14]) == 3  # the width measurements, at the stress the runs trained under
    assert measurements(sweep, ["bias/dose/margin1[0-1]"]).keys() == {10}


def test_each_shape_gets_its_pooled_figures_per_margin(sweep):
    rows = onset_rows(sweep, ["bias/dose/margin*", "bias/width"])
    assert [(r["head_dim"], r["seq_len"]) for r in rows] == [(16, 128), (128, 512)]
    eight, one = rows
    assert list(eight["by_margin"]) == [10, 12, 14] and list(one["by_margin"]) == [14]
    twelve = eight["by_margin"][12]
    assert twelve["seeds"] == [0, 1] and twelve["debiased_sq"] == pytest.approx(0.0005)
    assert twelve["debiased_sq_se"] == pytest.approx(0.0001)  # between the two seeds
    assert twelve["log2_rms_scaled"] == pytest.approx(-8.0)


def test_the_command_writes_the_table_and_refuses_a_sweep_with_nothing_measured(sweep, tmp_path, capsys):
    out = tmp_path / "out"
    assert main([str(sweep), "--out", str(out)]) == 0
    table = (out / "onset.md").read_text()
    assert "| K 10 | K 12 | K 14 |" in table
    assert "| 16 | 128 | layers.0.attn | 0,1 | +1.0 ± 1.0 (-6.0) | +5.0 ± 1.0 (-8.0) | +81.0 ± 1.0 (-8.0) |" in table
    assert "| 128 | 512 | layers.0.attn | 0 |  |  | +10.0 ± 4.0 (-8.0) |" in table
    measured_run(sweep / "T128", "h8s2", heads=8, seq_len=128, seed=2, debiased=0.0081, z=-3.0)  # no dose
    assert main([str(sweep), "--out", str(out)]) == 0
    assert "| 16 | 128 | layers.0.attn | 0,1 (K 10,12); 0,1,2 (K 14) |" in (out / "onset.md").read_text()
    assert json.loads((out / "onset.json").read_text())["rows"][0]["by_margin"]["12"]["seeds"] == [0, 1]
    assert (out / "onset.png").stat().st_size > 0
    with pytest.raises(SystemExit) as stop:
        main([str(sweep), "--out", str(out), "--measured", "bias/nowhere"])
    assert stop.value.code == 2 and "no run under" in capsys.readouterr().err
