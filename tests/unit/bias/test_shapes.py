"""The shape table: runs found by their meter's output, their shape read from their config,
seeds pooled with the between-seed SE (the meter's own for a single seed)."""

from __future__ import annotations

import json
import math

import pytest

from meter_records import measured_run
from readback.bias.shapes import _last_rowsum_z, length_contrasts, measured_runs, pool, run_point
from readback.cli.bias_shapes import main


@pytest.fixture
def sweep(tmp_path):
    measured_run(tmp_path / "T128", "a", heads=8, seq_len=128, seed=0, debiased=0.0016, z=-4.0)
    measured_run(tmp_path / "T128", "b", heads=8, seq_len=128, seed=1, debiased=0.0036, z=-6.0)
    measured_run(tmp_path / "T512", "c", heads=1, seq_len=512, seed=0, debiased=-0.001, z=-2.0)
    (tmp_path / "T512" / "unmeasured" / "bias").mkdir(parents=True)
    return tmp_path


def test_a_run_gives_its_shape_and_its_layers_figures(sweep):
    point = run_point(sweep / "T128" / "a")
    assert (point["head_dim"], point["seq_len"], point["seed"]) == (16, 128, 0)
    layer = point["layers"]["layers.0.attn"]
    assert layer["share"] == pytest.approx(0.04) and layer["share_se"] == pytest.approx(0.0004 / (2 * 0.04))
    assert layer["rowsum_z"] == -4.0  # the last record that has it
    assert run_point(sweep / "T512" / "c")["layers"]["layers.0.attn"]["share"] == 0.0  # below its floor


def test_seeds_pool_with_the_between_seed_se_and_one_seed_keeps_the_meters(sweep):
    runs = measured_runs(sweep)
    assert [r.name for r in runs] == ["a", "b", "c"]
    rows = pool([run_point(r) for r in runs])
    assert [(r["head_dim"], r["seq_len"], r["seeds"]) for r in rows] == [(16, 128, [0, 1]), (128, 512, [0])]
    two, one = rows
    assert two["share"] == pytest.approx(0.05) and two["share_se"] == pytest.approx(0.01)  # 0.04, 0.06
    assert two["debiased_sq"] == pytest.approx(0.0026) and two["debiased_sq_se"] == pytest.approx(0.001)
    assert one["debiased_sq"] == -0.001 and one["share"] == 0.0  # the square unclipped, its root clipped
    assert two["rel_err"] == pytest.approx(0.7) and two["rel_err_se"] == pytest.approx(0.5)
    assert two["rowsum_z"] == -5.0
    assert one["projection_se"] == 0.002 and math.isnan(one["rel_err_se"])


def test_the_command_writes_its_files_and_refuses_an_empty_sweep(sweep, tmp_path, capsys):
    out = tmp_path / "out"
    assert main([str(sweep), "--out", str(out)]) == 0
    table = (out / "shapes.md").read_text()
    assert "| 16 | 128 | layers.0.attn | 0,1 | 0.05 ± 0.01 |" in table
    assert json.loads((out / "shapes.json").read_text())["rows"][1]["head_dim"] == 128
    assert (out / "shapes.png").stat().st_size > 0
    with pytest.raises(SystemExit) as stop:
        main([str(sweep / "T512" / "unmeasured"), "--out", str(out)])
    assert stop.value.code == 2 and "no run under" in capsys.readouterr().err
    assert main([str(sweep), "--out", str(out), "--seeds", "1"]) == 0
    assert [r["seed"] for r in json.loads((out / "shapes.json").read_text())["runs"]] == [1]
    with pytest.raises(SystemExit) as stop:
        main([str(sweep), "--out", str(out), "--seeds", "7"])
    assert stop.value.code == 2 and "no run of seeds 7 under" in capsys.readouterr().err


def test_each_longer_length_is_contrasted_with_the_shortest_at_the_same_head_dim(sweep):
    measured_run(sweep / "T512", "d", heads=8, seq_len=512, seed=0, debiased=0.0004, z=-1.0)
    measured_run(sweep / "T128", "e", heads=1, seq_len=128, seed=0, debiased=0.0025, z=-1.0)
    rows = pool([run_point(r) for r in measured_runs(sweep)])
    by_dim = {c["head_dim"]: c for c in length_contrasts(rows)}
    assert set(by_dim) == {16, 128, "all"} and {c["against"] for c in by_dim.values()} == {128}
    sixteen, one_head, both = by_dim[16], by_dim[128], by_dim["all"]
    assert sixteen["difference"] == pytest.approx(0.0004 - 0.0026)  # one seed at T 512, two at T 128
    assert sixteen["difference_se"] == pytest.approx(math.hypot(0.0004, 0.001))
    assert sixteen["share_ratio"] == pytest.approx(0.02 / 0.05)
    assert one_head["difference"] == pytest.approx(-0.001 - 0.0025) and one_head["share_ratio"] == 0.0
    assert both["difference"] == pytest.approx((sixteen["difference"] + one_head["difference"]) / 2)
    assert both["difference_se"] == pytest.approx(math.hypot(sixteen["difference_se"], one_head["difference_se"]) / 2)
    assert both["z"] == pytest.approx(both["difference"] / both["difference_se"])
    assert math.isnan(sixteen["dof"])  # one seed at T 512: no between-seed SE to count
    assert length_contrasts([r for r in rows if r["seq_len"] == 128]) == []  # one length: nothing to contrast


def test_welch_degrees_of_freedom_count_each_arms_seeds(sweep):
    for name, seed, debiased in (("d", 0, 0.0004), ("f", 1, 0.0010), ("g", 2, 0.0016)):
        measured_run(sweep / "T512", name, heads=8, seq_len=512, seed=seed, debiased=debiased, z=-1.0)
    rows = pool([run_point(r) for r in measured_runs(sweep)])
    short, long = (r for r in rows if r["head_dim"] == 16)
    a, b = short["debiased_sq_se"] ** 2, long["debiased_sq_se"] ** 2  # 2 seeds and 3 seeds
    contrast = next(c for c in length_contrasts(rows) if c["head_dim"] == 16)
    assert contrast["dof"] == pytest.approx((a + b) ** 2 / (a * a / 1 + b * b / 2))
    assert 1.0 < contrast["dof"] < 3.0


def test_the_row_sum_z_is_the_last_records_and_a_torn_last_line_is_skipped(tmp_path):
    """A run killed mid-write leaves half a line: the z of the last whole record stands."""
    metrics = tmp_path / "metrics.jsonl"
    records = [{"step": 10, "attn_rowsum/z/layers.0.attn.core": -1.0}, {"step": 20, "loss": 3.0}]
    records.append({"step": 30, "attn_rowsum/z/layers.0.attn.core": -2.5})
    metrics.write_text("".join(json.dumps(r) + "\n" for r in records) + '{"step": 40, "attn_rowsum/z/lay')
    assert _last_rowsum_z(metrics) == {"layers.0.attn.core": -2.5}
    assert _last_rowsum_z(tmp_path / "missing.jsonl") == {}
