"""scripts/gpu_check.sh as a process: on this machine's CPU torch it prints the versions, says in
one line that it needs a CUDA torch and runs nothing; under a stand-in Python that plays a GPU
machine's plan and parts, it runs the parts marked run, reports the others as not run, counts
failures, and stops after the first training steps when they fail. And the policy runs' own
train.py commands, trained on the CPU."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import gpu_env
import gpu_policy_runs
from toys import REPO

SCRIPT = REPO / "scripts" / "gpu_check.sh"
# The stand-in for python: the plan is $FAKE_PLAN; a part passes (pytest's "3 passed") unless its
# command line holds $FAKE_FAIL.
FAKE_PYTHON = """#!/usr/bin/env bash
case "$1" in
  scripts/gpu_env.py) cat "$FAKE_PLAN" ;;
  scripts/versions.py) echo "Python 3.12.3, torch 2.11.0+cu130, CUDA 13.0, GPU NVIDIA H200 sm90" ;;
  *) echo "ran $*"; [ "$2" = pytest ] && echo "3 passed"; [[ -n "$FAKE_FAIL" && "$*" == *"$FAKE_FAIL"* ]] && exit 1 ;;
esac
exit 0
"""


def _check(tmp_path: Path, python: str, **env: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": python, "FAKE_FAIL": "", **env}
    return subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=env, timeout=180)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine the check runs for real")
def test_without_a_cuda_torch_it_prints_the_versions_says_so_in_one_line_and_runs_nothing(tmp_path):
    result = _check(tmp_path, sys.executable)
    lacking = "a CPU-only build" if torch.version.cuda is None else "which sees none"  # PyPI's torch is a CUDA build
    needs = "a CUDA build of torch" if torch.version.cuda is None else "a CUDA device"
    line = f"gpu_check: needs {needs}; {sys.executable} has torch {torch.__version__}, {lacking}: nothing run\n"
    versions, refusal = result.stdout.splitlines(keepends=True)
    assert versions.startswith(f"Python {platform.python_version()}, torch {torch.__version__}, ")
    assert (result.returncode, refusal, result.stderr) == (100, line, "")
    out = tmp_path / "out"  # nothing else ran: no plan, no part's log
    assert sorted(p.name for p in out.iterdir()) == ["gpu_env.log", "summary.txt", "versions.txt"]
    assert (out / "summary.txt").read_text() == line and (out / "gpu_env.log").read_text() == ""
    assert (out / "versions.txt").read_text() == versions


@pytest.fixture
def fake_python(tmp_path) -> str:
    path = tmp_path / "python"
    path.write_text(FAKE_PYTHON)
    path.chmod(0o755)
    return str(path)


def _plan(tmp_path: Path, not_run: dict[str, str]) -> str:
    plan = tmp_path / "plan"
    lines = [f"{p.name}: not run: {not_run[p.name]}" if p.name in not_run else f"{p.name}: run" for p in gpu_env.PARTS]
    plan.write_text("\n".join(lines) + "\n")
    return str(plan)


TE_MISSING = dict.fromkeys(("te_tests", "te_benchmark"), "Transformer Engine (transformer_engine)")


def test_without_te_it_runs_the_other_parts_and_names_the_ones_that_did_not_run(tmp_path, fake_python):
    result = _check(tmp_path, fake_python, FAKE_PLAN=_plan(tmp_path, TE_MISSING))
    summary = (tmp_path / "out" / "summary.txt").read_text().splitlines()
    assert result.returncode == 0, result.stdout
    assert [line.split(":")[0] for line in summary[:-1]] == [p.name for p in gpu_env.PARTS]
    ran = ("first_steps", "emulated_tests", "accumulation", "policy_runs", "audit", "kernel_tests", "kernel_benchmark")
    for name in (*ran, "benchmark", "kernel_step"):
        assert (tmp_path / "out" / f"{name}.log").read_text().startswith("ran "), name
    assert "te_tests: not run: Transformer Engine (transformer_engine)" in summary
    assert summary[-1].endswith(
        ": 9 part(s) ran, 0 failed; not run: te_tests (Transformer Engine (transformer_engine)); "
        "te_benchmark (Transformer Engine (transformer_engine))"
    )
    assert not (tmp_path / "out" / "te_tests.log").exists()
    assert "--seq 1024 4096 --micro-batch 8 2" in (tmp_path / "out" / "benchmark.log").read_text()
    assert "--cases emulated_reuse_rounded_ops" in (tmp_path / "out" / "kernel_step.log").read_text()


def test_the_exit_code_counts_the_failed_parts(tmp_path, fake_python):
    result = _check(tmp_path, fake_python, FAKE_PLAN=_plan(tmp_path, TE_MISSING), FAKE_FAIL="readback.cli.audit")
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert result.returncode == 1 and "audit: FAILED rc=1" in summary and "9 part(s) ran, 1 failed" in summary


def test_failed_first_steps_stop_the_check_before_the_long_parts(tmp_path, fake_python):
    result = _check(tmp_path, fake_python, FAKE_PLAN=_plan(tmp_path, {}), FAKE_FAIL="--runs reuse_rounded")
    summary = (tmp_path / "out" / "summary.txt").read_text().splitlines()
    assert result.returncode == 1
    assert summary[0].startswith("first_steps: FAILED rc=1")
    assert summary[1:] == ["gpu_check: the first training steps failed (first_steps.log): no other part run"]
    assert "--steps 3 --runs reuse_rounded" in (tmp_path / "out" / "first_steps.log").read_text()
    assert not (tmp_path / "out" / "emulated_tests.log").exists()


def test_a_check_that_ran_no_part_fails(tmp_path, fake_python):
    not_run = {p.name: "a CUDA device visible to torch 2.11.0+cu130" for p in gpu_env.PARTS}
    result = _check(tmp_path, fake_python, FAKE_PLAN=_plan(tmp_path, not_run))
    summary = (tmp_path / "out" / "summary.txt").read_text().splitlines()
    assert result.returncode == 100 and summary[-1] == "gpu_check: no part ran"
    assert summary[-2].endswith(
        ": 0 part(s) ran, 0 failed; not run: "
        + "; ".join(f"{p.name} (a CUDA device visible to torch 2.11.0+cu130)" for p in gpu_env.PARTS)
    )


@pytest.mark.slow
def test_the_policy_runs_train_on_the_cpu_as_they_would_on_cuda(tmp_path, capsys):
    """scripts/gpu_policy_runs.py's own train.py commands, one step each on the CPU (about 30 s)."""
    assert gpu_policy_runs.main(["--out", str(tmp_path), "--device", "cpu", "--steps", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()[-len(gpu_policy_runs.RUNS) :]
    assert [line.split()[:2] for line in lines] == [[name, "ok:"] for name in gpu_policy_runs.RUNS]
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == sorted(gpu_policy_runs.RUNS)
