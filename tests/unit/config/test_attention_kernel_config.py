"""``attention.kernel``: ``auto`` runs the ops core off CUDA (the CPU's runs keep their bits), the
spec carries the core that runs, ``site_implementations`` names it, and ``triton`` is refused in
one line naming ``attention.kernel=ops`` where it cannot run: no CUDA and no interpreter, or
settings the kernel does not run."""

import os
import subprocess
import sys

import pytest
import torch

from readback.backends import site_implementations
from readback.config import validate
from readback.errors import ConfigError
from readback.numerics.state import Numerics
from readback.ops import attention_triton, numerics_spec
from toys import REPO, TWO_STEP_RUN, compose

pytest.importorskip("triton", reason="triton is not installed")


def test_auto_runs_the_ops_core_on_a_cpu(monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    cfg = validate(compose("+experiment=reuse_rounded"))
    assert cfg.attention.kernel == "auto"
    numerics = Numerics(numerics_spec(cfg.numerics))
    assert numerics.spec.attention.kernel == "auto"
    assert not attention_triton.runs(numerics, "layers.0.attn.core", torch.zeros(1, 2, 16, 64))
    assert site_implementations(cfg)["attention_core"] == "readback.ops.attention"


# FP8 and BF16 backward, each with a rounding of dO or dS set apart, and the FP32 backward
@pytest.mark.parametrize(
    "overrides",
    [
        ("+experiment=fresh_reround",),
        ("+experiment=reuse_rounded_bf16_bwd",),
        ("+experiment=reuse_rounded", "attention.round_grad_scores=false"),
        ("+experiment=reuse_rounded_bf16_bwd", "attention.round_grad_output=true"),
        ("+experiment=reuse_rounded", "attention.bwd_precision=fp32"),
    ],
)
def test_triton_under_the_interpreter_is_the_spec_s_and_the_summary_s(monkeypatch, overrides):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cfg = validate(compose(*overrides, "attention.kernel=triton"))
    assert numerics_spec(cfg.numerics).attention.kernel == "triton"
    assert site_implementations(cfg)["attention_core"] == "readback.ops.attention on readback.kernels (Triton)"


@pytest.mark.parametrize(
    "overrides, reason",
    [
        (("+experiment=bf16_baseline",), "precision=fp8 only"),
        (("+experiment=reuse_rounded", "model.d_model=96", "model.n_heads=2"), "model head_dim is 48"),
        (("+experiment=reuse_rounded", "probe.bias_every=10"), "the bias meter's variants"),
    ],
)
def test_settings_the_kernel_does_not_run_are_refused(monkeypatch, overrides, reason):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ConfigError) as error:
        validate(compose(*overrides, "attention.kernel=triton"))
    assert error.value.key == "attention.kernel" and reason in str(error.value) and "valid: ops" in str(error.value)


def test_the_reference_s_fp64_backward_is_refused():  # no config reaches it: the op's own check
    why = attention_triton.settings_refused(True, "fp64", "forward", True)
    assert why is not None and "bwd_precision=fp8 or fp32 with bwd_reads=forward" in why
    assert attention_triton.settings_refused(True, "fp32", "forward", True) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="the kernel runs on CUDA")
def test_train_py_refuses_triton_without_cuda_or_the_interpreter_in_one_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"OMP_NUM_THREADS": "1"}
    args = [*TWO_STEP_RUN, "+experiment=reuse_rounded", "attention.kernel=triton", f"hydra.run.dir={tmp_path}/run"]
    proc = subprocess.run(
        [sys.executable, "train.py", *args], cwd=REPO, env=env | {"WANDB_MODE": "disabled"}, capture_output=True,
        text=True, timeout=180,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.count("\n") == 1 and "attention.kernel='triton' is not valid; valid: ops" in proc.stderr
    assert "TRITON_INTERPRET=1" in proc.stderr and not (tmp_path / "run").exists()
