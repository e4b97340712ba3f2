"""readback.analysis.decisions.te_reads_meter: the pre-registered calls on meter records built to cross each line."""

from __future__ import annotations

import json

from readback.analysis.decisions.te_reads_meter import decide, report


def _stats(debiased: float = 0.0, se: float = 1e-5) -> dict:
    return {"debiased_sq": debiased, "debiased_sq_se": se, "projection": 0.0, "projection_se": 0.01, "floor": 0.01}


def _cell(root, checkpoint, t, rounding, te_reads: dict) -> None:
    """A ``bias.json`` of the ``--parts bf16,bf16+qkv+probs`` meter: te_reads at zero but for ``te_reads``."""
    stats = {f"te_reads@{p}": {"total": te_reads.get(p, _stats())} for p in ("reuse_rounded", "no_saved_copy")}
    stats["reuse_vs_fresh@bf16"] = {"total": _stats(1.0)}  # another contrast: never read here
    out = root / checkpoint / "bias" / f"T{t}-{rounding}-te_reads"
    out.mkdir(parents=True)
    (out / "bias.json").write_text(json.dumps({"batches": 8, "cpu": "AMD EPYC, AVX512", "stats": stats}))


def test_detected_and_growth_cross_three_standard_errors(tmp_path):
    _cell(tmp_path, "d2", 512, "nearest", {"reuse_rounded": _stats(1e-5)})
    _cell(tmp_path, "d2", 4096, "nearest", {"reuse_rounded": _stats(5.3e-5), "no_saved_copy": _stats(2.99e-5)})
    _cell(tmp_path, "d8", 4096, "nearest", {"reuse_rounded": _stats(9.5e-5)})
    calls = decide(tmp_path)["calls"]
    r, c = calls["reuse_rounded"], calls["no_saved_copy"]
    assert r["detected_at_longest_T_in"] == ["d2 T 4096 nearest", "d8 T 4096 nearest"]
    assert c["detected_at_longest_T_in"] == []  # 2.99 SE
    assert r["grows_with_T"] == ["nearest"]  # 4.3e-5 against 3 x 1.41e-5 = 4.24e-5
    assert r["grows_with_depth"] == []  # 4.2e-5 against 4.24e-5
    assert calls["fresh_reround"]["detected_at_longest_T_in"] == []  # not measured: nothing called


def test_the_report_writes_figures_to_two_digits_of_their_se(tmp_path):
    _cell(tmp_path, "d2", 4096, "nearest", {"reuse_rounded": _stats(1.234e-4, 3.1e-5)})
    text = report(decide(tmp_path))
    assert "+0.000123 ± 0.000031" in text and "te_reads@reuse_rounded (detected)" in text
