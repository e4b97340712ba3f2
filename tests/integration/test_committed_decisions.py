"""The committed decisions are what their committed records give: each results folder's
``runs*.tar.xz``, extracted and passed through its decision (``readback.analysis.decisions``),
writes the committed ``decision.json`` again. A page may say no more than its records show, so a
record or a decision edited by hand, or a decision's code changed after its call, fails here."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import pytest

from readback.analysis.decisions import bf16_fix_cost, parts_ladder, study_setting, te_reads_meter

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results" / "d_term"

CASES = [
    ("bf16_fix_cost", bf16_fix_cost, "bf16_fix_cost"),
    ("bf16_fix_cost_meters", te_reads_meter, "bf16_fix_cost_ladder"),
    ("parts_ladder", parts_ladder, "multirun/parts_ladder"),
    ("study_setting", study_setting, "multirun/study_setting"),
]


@pytest.mark.parametrize(("folder", "script", "sweep"), CASES, ids=[c[0] for c in CASES])
def test_the_committed_decision_is_its_records(tmp_path, folder, script, sweep):
    for records in sorted((RESULTS / folder).glob("runs*.tar.xz")):  # one archive per test, each under 5 MiB
        with tarfile.open(records) as tar:
            tar.extractall(tmp_path, filter="data")
    decision = script.decide(tmp_path / sweep)

    assert json.loads(json.dumps(decision)) == json.loads((RESULTS / folder / "decision.json").read_text())
    assert script.report(decision).rstrip("\n") == (RESULTS / folder / "decision.md").read_text().rstrip("\n")
