"""scripts/dose_table.py: one row per margin, the numbers of dose.json in their columns."""

from __future__ import annotations

from dose_table import dose_table


def _stats(bias: float) -> dict:
    keys = ("bias", "bias_se", "projection", "projection_se", "debiased_sq", "debiased_sq_se")
    return {"g": dict(zip(keys, (bias, 0.01, 0.1 * bias, 0.002, bias * bias, 0.0001)))}


def test_one_row_per_margin_with_each_reads_figures():
    points = [
        {
            "margin": k,
            "stats": {"contrib.exact_read.attention.D": _stats(0.1 * k), "contrib.fresh_reround": _stats(0.01)},
            "o_rounding": {"layers.0.attn": {"underflow": 0.05 * k, "rel_err": 0.02}},
        }
        for k in (0, 8)
    ]
    lines = dose_table({"points": points}, "g").splitlines()
    assert len(lines) == 4 and lines[0].startswith("| K | D read: bias (floor)")
    assert lines[3].split(" | ")[:4] == ["| 8", "0.8000 (0.0100)", "+0.0800 ± 0.0020", "+0.64000 ± 0.00010"]
    assert lines[3].endswith("| 0.400 | 0.020 |")
    for point in points:  # a newer meter also says where O's rms lands on O8's grid
        point["o_rounding"]["layers.0.attn"]["log2_rms_scaled"] = 4.0 - point["margin"]
    lines = dose_table({"points": points}, "g").splitlines()
    assert lines[0].endswith("| log2(rms(O) * scale) (layers.0.attn) |") and lines[3].endswith("| 0.020 | -4.00 |")
