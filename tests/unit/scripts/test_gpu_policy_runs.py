"""scripts/gpu_policy_runs.py: the train.py commands it runs (every policy and BF16, a valid
head-dim-128 FOG) and its verdict on run directories (completed, every loss finite)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import gpu_policy_runs
from readback.config import validate
from toys import compose

STEPS = 20


def _jobs(device: str) -> dict[str, list[str]]:
    """run directory name -> the overrides its train.py job composes (the multirun expanded)."""
    policies, baseline = gpu_policy_runs.train_commands(Path("/out"), device, STEPS)
    assert policies[2] == "-m" and baseline[2] == "+experiment=bf16_baseline"
    swept = next(a for a in policies if a.startswith("policy="))
    shared = [a for a in policies[3:] if a != swept and not a.startswith("hydra.")]
    jobs = {p: [*shared, f"policy={p}"] for p in swept.removeprefix("policy=").split(",")}
    jobs["bf16_baseline"] = [a for a in baseline[2:] if not a.startswith("hydra.")]
    return jobs


def test_every_policy_and_the_bf16_baseline_run_once_each_in_their_own_directory():
    policies, baseline = gpu_policy_runs.train_commands(Path("/out"), "cuda", STEPS)
    assert set(_jobs("cuda")) == set(gpu_policy_runs.RUNS)
    assert {"hydra.sweep.dir=/out", "hydra.sweep.subdir=${policy}"} <= set(policies)
    assert baseline[-1] == "hydra.run.dir=/out/bf16_baseline"


def test_the_first_steps_are_one_reuse_rounded_run_and_its_report_names_it_alone(tmp_path):
    """gpu_check.sh's first part: ``--runs reuse_rounded`` trains that policy only."""
    (command,) = gpu_policy_runs.train_commands(tmp_path, "cuda", 3, ("reuse_rounded",))
    assert "policy=reuse_rounded" in command and "trainer.steps=3" in command
    _write_run(tmp_path / "reuse_rounded", [5.0] * 3, steps=3)
    lines, failed = gpu_policy_runs.report(tmp_path, 3, ("reuse_rounded",))
    assert (failed, len(lines)) == (0, 1)


@pytest.mark.parametrize("run", gpu_policy_runs.RUNS)
def test_each_run_is_a_valid_head_dim_128_fog_of_20_logged_steps(run):
    overrides = _jobs("cpu")[run]
    config = validate(compose(*overrides))  # trainer.device=cuda is refused on a CPU machine: cpu here
    assert config.model.d_model // config.model.n_heads == 128
    assert config.policy == ("exact" if run == "bf16_baseline" else run)
    assert config.precision.name == ("bf16" if run == "bf16_baseline" else "fp8")
    assert (config.trainer.steps, config.trainer.log_every, config.logger.name) == (STEPS, 1, "none")
    assert compose(*_jobs("cuda")[run]).trainer.device == "cuda"


def _write_run(run_dir: Path, losses, *, status="completed", steps=STEPS, val_loss=3.0) -> Path:
    run_dir.mkdir(parents=True)
    records = [{"step": i + 1, "loss": loss} for i, loss in enumerate(losses)] + [{"step": steps, "val_loss": val_loss}]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    summary = {"status": status, "steps": steps, "final_loss": losses[-1], "val_loss": val_loss, "wall_time_s": 4.2}
    (run_dir / "summary.json").write_text(json.dumps(summary))
    return run_dir


def test_a_completed_run_with_finite_losses_passes(tmp_path):
    assert gpu_policy_runs.check_run(_write_run(tmp_path / "r", [5.0 - 0.1 * i for i in range(STEPS)]), STEPS) is None


@pytest.mark.parametrize(
    "losses, kwargs, problem",
    [
        ([5.0] * 10 + [None] + [5.0] * 9, {}, "a non-finite loss"),  # NaN is written as null
        ([5.0] * STEPS, {"val_loss": None}, "a non-finite loss"),
        ([5.0] * 12, {"status": "diverged", "steps": 12}, "status diverged after 12 of 20 steps"),
        ([5.0] * 19, {}, "19 losses logged for 20 steps"),
    ],
)
def test_a_run_that_did_not_train_cleanly_is_named(tmp_path, losses, kwargs, problem):
    assert gpu_policy_runs.check_run(_write_run(tmp_path / "r", losses, **kwargs), STEPS) == problem


def test_the_report_has_a_line_per_run_and_counts_the_failures(tmp_path):
    for name in gpu_policy_runs.RUNS[:-1]:
        _write_run(tmp_path / name, [5.0] * STEPS)
    lines, failed = gpu_policy_runs.report(tmp_path, STEPS)
    assert failed == 1 and len(lines) == len(gpu_policy_runs.RUNS)
    assert lines[0] == "reuse_rounded    ok: final loss 5.0000, val loss 3.0000, 4.2 s"
    assert lines[-1] == "bf16_baseline    FAILED: no summary.json"
