"""scripts/refactor_check.py: what counts as a difference between two runs' files."""

from __future__ import annotations

from refactor_check import UNCOMPARED, differences


def test_differences_name_every_changed_missing_and_added_key():
    base = {"summary.json": {"loss": 1.0, "steps": 2}, "metrics.jsonl": [{"step": 1, "x": float("nan")}]}
    head = {"summary.json": {"loss": 1.5, "new": 3}, "metrics.jsonl": [{"step": 1, "x": float("nan")}, {"step": 2}]}
    assert differences(base, head) == [
        ".metrics.jsonl: 1 entries in base, 2 in head",  # a record more is a change, not an added key
        ".summary.json.new: only in head",
        ".summary.json.steps: only in base",
        ".summary.json.loss: 1.0 -> 1.5",
    ]
    assert differences(base, base) == []  # NaN equals NaN


def test_wall_clock_measurements_and_the_run_folder_are_not_compared():
    assert {"tokens_per_s", "wall_time_s", "run_dir", "code"} <= UNCOMPARED and "loss" not in UNCOMPARED


def test_extra_overrides_reach_the_run_command(tmp_path, monkeypatch):
    import subprocess

    import refactor_check

    commands = []

    def fake_run(cmd, **kwargs):
        commands.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(refactor_check.subprocess, "run", fake_run)
    case = refactor_check.Case("plain", ("+experiment=reuse_rounded",))
    refactor_check.run_case(tmp_path, case, tmp_path / "run", ("precision.bf16_gemm=native",))
    assert commands[0][-2:] == ["precision.bf16_gemm=native", f"hydra.run.dir={tmp_path / 'run'}"]
