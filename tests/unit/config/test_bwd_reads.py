"""``attention.bwd_reads``: the study's BF16-backward experiment reads what Transformer Engine's
BF16 attention backward reads, the old reads stay one setting away, and combinations that cannot
mean anything are refused in one line."""

import os
import subprocess
import sys

import pytest

from readback.config import validate
from readback.errors import ConfigError
from readback.ops import read_rules
from toys import ALL_EXPERIMENTS, REPO, TWO_STEP_RUN, compose


@pytest.mark.parametrize("experiment", ALL_EXPERIMENTS)
def test_only_the_bf16_backward_experiments_read_as_te(experiment):
    cfg = compose(f"+experiment={experiment}")
    te = experiment in ("reuse_rounded_bf16_bwd", "original_bf16_bwd")
    assert cfg.attention.bwd_reads == ("te" if te else "forward")


def test_the_spec_carries_the_flavour_and_its_reads():
    from readback.ops import numerics_spec

    for bwd_reads in ("te", "forward"):
        c = validate(compose("+experiment=reuse_rounded_bf16_bwd", f"attention.bwd_reads={bwd_reads}"))
        spec = numerics_spec(c.numerics)
        assert spec.attention.bwd_reads == bwd_reads and spec.bwd_gemm_precision == "bf16"
        assert spec.reads == read_rules("reuse_rounded", c.attention)


@pytest.mark.parametrize(
    "overrides, reason",
    [
        (("+experiment=reuse_rounded",), "with bwd_precision=fp8"),
        (("+experiment=reuse_rounded", "attention.bwd_precision=fp32"), "with bwd_precision=fp32"),
        (("+experiment=bf16_baseline",), "with precision=bf16"),
        (("+experiment=reuse_rounded_bf16_bwd", "policy=exact"), "with policy=exact"),
    ],
)
def test_te_reads_where_they_mean_nothing_are_refused(overrides, reason):
    with pytest.raises(ConfigError) as error:
        validate(compose(*overrides, "attention.bwd_reads=te"))
    assert error.value.key == "attention.bwd_reads" and reason in str(error.value)


def test_train_py_refuses_in_one_line_with_exit_2(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    args = [*TWO_STEP_RUN, "+experiment=no_saved_copy", "attention.bwd_reads=te", f"hydra.run.dir={tmp_path}/run"]
    proc = subprocess.run(
        [sys.executable, "train.py", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.count("\n") == 1 and "attention.bwd_reads='te' is not valid; valid: forward" in proc.stderr
    assert not (tmp_path / "run").exists()
