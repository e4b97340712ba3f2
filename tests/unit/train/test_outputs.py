"""``readback.outputs`` is the table of what a run writes: a short real run writes no metric family
and no summary key it lacks, and every family it declares is written (but the GPU's and a
divergence's), so the table neither misses a writer's family nor keeps one nobody writes."""

from __future__ import annotations

import json

from readback.outputs import METRIC_FAMILIES, SUMMARY_KEYS, family
from readback.train import run
from readback.train.records.metrics import read_jsonl
from toys import TWO_STEP_RUN, config

# Written only on CUDA (mfu, mem_gib), by a failed run (error) or at a non-finite step (diverged).
NOT_IN_A_CPU_RUN = {"mfu", "mem_gib", "diverged"}

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
    assert list(on_disk) == list(summary) == [key for key in SUMMARY_KEYS if key != "error"]


def test_a_family_is_what_comes_before_the_first_slash():
    assert family("grad_error/rel_err/total") == "grad_error"
    assert family("attn_rowsum/z/layers.0.attn.core") == "attn_rowsum"
    assert family("loss") == "loss"


def test_the_families_the_readers_look_up_are_declared():
    """The analysis' plots and wandb's curves name families by string: each is one the table has."""
    from readback.analysis.load import SUMMARY_FIELDS
    from readback.analysis.mechanism_plots import MECHANISM
    from readback.analysis.plots import PLOTS
    from readback.train.records.tracking import TOKEN_AXIS_KEYS

    looked_up = {family(prefix) for prefix, _ in MECHANISM} | {family(glob) for glob in TOKEN_AXIS_KEYS}
    looked_up |= PLOTS.keys() - {"mechanism"}  # a plot of its own families
    assert sorted(looked_up - METRIC_FAMILIES.keys()) == []
    assert sorted(set(SUMMARY_FIELDS) - SUMMARY_KEYS.keys()) == []
