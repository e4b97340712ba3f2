"""``readback.outputs`` is the table of what a run writes: the writers refuse a metric family or a
summary key it lacks, and short real runs (trained, failed, dry) write every one it declares (but
the GPU's and a divergence's), so the table neither misses a writer's key nor keeps one nobody
writes."""

from __future__ import annotations

import json

import pytest

from readback.outputs import METRIC_FAMILIES, SUMMARY_KEYS, family, in_summary_order
from readback.train import run
from readback.train.records.metrics import JsonlWriter, MetricsLogger, read_jsonl
from readback.train.records.summary import SummaryWriter, write_summary
from toys import TWO_STEP_RUN, config

# Written only on CUDA (mfu, mem_gib), by a failed run (error) or at a non-finite step (diverged).
NOT_IN_A_CPU_RUN = {"mfu", "mem_gib", "diverged"}
# Written by a failed run (error) or by a dry run (its estimates, its TE plan) only.
NOT_IN_A_TRAINED_RUN = {"error", "memory_gb", "te_plan"}

# Every writer on: the probe with repeats (bias, noise and their errors), the bias meter over 4
# batches (every statistic), delayed scaling over 2 steps (the history amax), FP8 in every layer.
EVERY_WRITER = (
    *TWO_STEP_RUN,
    "trainer.device=cpu",
    "precision.recipe=delayed",
    "precision.bf16_layers=[]",
    "probe.every=1",
    "probe.repeats=2",
    "probe.bias_every=2",
    "probe.bias_batches=4",
)


def test_a_run_writes_the_declared_families_and_summary_keys(tmp_path):
    summary = run(config(*EVERY_WRITER), tmp_path)
    written = {family(key) for record in read_jsonl(tmp_path / "metrics.jsonl") for key in record}
    assert sorted(written - METRIC_FAMILIES.keys()) == [], "families missing from readback.outputs.METRIC_FAMILIES"
    assert sorted(METRIC_FAMILIES.keys() - written) == sorted(NOT_IN_A_CPU_RUN)
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert list(on_disk) == list(summary) == [key for key in SUMMARY_KEYS if key not in NOT_IN_A_TRAINED_RUN]


def test_a_failed_run_writes_the_error_last(tmp_path):
    SummaryWriter(tmp_path, is_main=True).write_failed({"status": "completed", "steps": 2}, RuntimeError("boom"))
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk == {"status": "failed", "steps": 2, "error": "RuntimeError: boom"}
    assert list(on_disk) == ["status", "steps", "error"]


def test_a_dry_run_writes_declared_keys_with_its_estimates(tmp_path):
    run(config(*TWO_STEP_RUN, "trainer.device=cpu", "trainer.dry_run=true", "backend=te"), tmp_path)
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert sorted(on_disk.keys() - SUMMARY_KEYS.keys()) == []
    assert {"memory_gb", "te_plan"} <= on_disk.keys() and on_disk["status"] == "dry_run"


UNDECLARED = r"^keys not declared in readback\.outputs: loss_spike$"


def test_the_writers_refuse_a_key_the_table_lacks(tmp_path):
    with pytest.raises(ValueError, match=UNDECLARED):
        write_summary(tmp_path, {"status": "completed", "loss_spike": 1.0})
    with pytest.raises(ValueError, match=UNDECLARED):
        MetricsLogger(JsonlWriter(tmp_path / "metrics.jsonl")).log({"step": 1, "loss_spike/layers.0": 1.0})
    with pytest.raises(ValueError, match=UNDECLARED):
        in_summary_order({"loss_spike": 1.0})
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_the_summary_is_in_the_tables_order_whatever_order_it_is_given_in():
    assert list(in_summary_order({"error": "e", "steps": 1, "status": "failed"})) == ["status", "steps", "error"]


def test_a_family_is_what_comes_before_the_first_slash():
    assert family("grad_error/rel_err/total") == "grad_error"
    assert family("attn_rowsum/z/layers.0.attn.core") == "attn_rowsum"
    assert family("loss") == "loss"


def test_the_families_the_readers_look_up_are_declared():
    """The analysis' plots and wandb's curves name families by string: each is one the table has."""
    from readback.analysis.load import SUMMARY_LEFT_OUT
    from readback.analysis.mechanism_plots import MECHANISM
    from readback.analysis.plots import PLOTS
    from readback.train.records.tracking import TOKEN_AXIS_KEYS

    looked_up = {family(prefix) for prefix, _ in MECHANISM} | {family(glob) for glob in TOKEN_AXIS_KEYS}
    looked_up |= PLOTS.keys() - {"mechanism"}  # a plot of its own families
    assert sorted(looked_up - METRIC_FAMILIES.keys()) == []
    assert sorted(SUMMARY_LEFT_OUT - SUMMARY_KEYS.keys()) == []  # what the analysis' rows leave out
