"""The dry run's ``backend=te`` plan: made for this machine's TE and GPU where it has them, for
the planning assumptions of ``backends.te.facts`` where not, and saying which it assumed."""

from __future__ import annotations

import pytest

from readback.backends.te import dry_run as te_dry_run
from readback.backends.te.facts import PLANNING_GPU, PLANNING_TE, Hardware
from readback.errors import ConfigError
from toys import config as compose

B200 = Hardware((10, 0), (9, 14, 0))


def _machine(monkeypatch, te: str | None, hardware: Hardware) -> None:
    monkeypatch.setattr(te_dry_run, "installed_te_version", lambda: te)
    monkeypatch.setattr(te_dry_run, "installed_hardware", lambda: hardware)


def test_without_te_or_gpu_the_plan_assumes_both_and_says_so(monkeypatch):
    _machine(monkeypatch, None, Hardware())
    lines, record = te_dry_run.dry_run_plan(compose("backend=te", "+experiment=reuse_rounded", "model=fog_390m"))
    assert lines[0] == f"backend=te plan for Transformer Engine {PLANNING_TE} on {PLANNING_GPU.describe()}:"
    assert lines[1].startswith(f"  assumed: Transformer Engine {PLANNING_TE} (none installed here")
    assert "GPU sm90 (H100, H200) with cuDNN 9.13.0 (no CUDA GPU here)" in lines[1]
    assert "  TE environment: NVTE_FP8_DPA_BWD=1, NVTE_DPA_FP8_RECIPE=, NVTE_FUSED_ATTN=1, NVTE_FLASH_ATTN=0" in lines
    assert record["assumed"] == ["te_version", "gpu"] and record["attention_core"] == "te"
    assert record["recipe_kwargs"]["fp8_dpa"] is True


def test_this_machines_te_and_gpu_are_used_when_present(monkeypatch):
    _machine(monkeypatch, "2.9.0", B200)
    cfg = compose("backend=te", "+experiment=reuse_rounded", "precision.recipe=current", "model=fog_390m")
    lines, record = te_dry_run.dry_run_plan(cfg)  # runs on sm100 (refused on the assumed sm90)
    assert lines[:2] == [
        "backend=te plan for Transformer Engine 2.9.0 on sm100, cuDNN 9.14.0:",
        "  assumed: nothing (this machine's Transformer Engine and GPU)",
    ]
    assert record["assumed"] == [] and record["recipe"] == "Float8CurrentScaling"
    _machine(monkeypatch, "2.9.0", Hardware())  # TE installed, no GPU: the GPU alone is assumed
    with pytest.raises(ConfigError, match=r"Transformer Engine 2\.9\.0 on sm90, cuDNN 9\.13\.0"):
        te_dry_run.dry_run_plan(cfg)
