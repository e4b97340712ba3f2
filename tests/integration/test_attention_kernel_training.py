"""A tiny FOG trained 20 steps through ``train.py`` on the Triton attention core (in Triton's
interpreter) against the ops core, under the FP8 backward (``reuse_rounded``) and TE's BF16
backward (``reuse_rounded_bf16_bwd``): the same losses and the same FP8 counts at every step.

Why they agree: the two cores' codes differ only where an FP32 sum of different order straddles
a rounding point (``tests/unit/kernels/test_attention_kernel.py``), which none does on this run
(the losses come out identical); the bound allows a loss a thousandth apart, far below one
step's change, and the counts a share of a thousandth. ``attn_rowsum`` (the D-term's row sums)
adds in another order in the kernel: it is held to 1e-4 relative. Every step is a log step, and
the kernel logs every metric the ops core does, the mechanism statistics included (their
figures against the ops core's: ``tests/unit/kernels/test_attention_kernel_mechanism.py``)."""

import json
import os
import subprocess
import sys

import pytest

from toys import REPO

pytest.importorskip("triton", reason="triton is not installed")

RUN = (
    "data=synthetic",
    "logger=none",
    "trainer.progress=false",
    "model.n_layers=1",
    "model.d_model=32",
    "model.n_heads=2",
    "model.n_kv_groups=1",
    "model.ffn_dim=64",
    "model.seq_len=32",
    "model.global_batch=4",
    "trainer.micro_batch=4",
    "trainer.steps=20",
    "trainer.log_every=1",
    "trainer.eval_every=20",
    "trainer.eval_batches=1",
)


def _train(experiment: str, kernel: str, tmp_path) -> list[dict]:
    run_dir = tmp_path / kernel
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled", TRITON_INTERPRET="1")
    cmd = [sys.executable, "train.py", f"+experiment={experiment}", *RUN, f"attention.kernel={kernel}"]
    cmd.append(f"hydra.run.dir={run_dir}")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed"
    core = summary["site_implementations"]["attention_core"]
    assert core.endswith("on readback.kernels (Triton)") == (kernel == "triton"), core
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("experiment", ["reuse_rounded", "reuse_rounded_bf16_bwd"])  # FP8, BF16 backward (te)
def test_twenty_steps_on_the_kernel_are_the_ops_core_s(tmp_path, experiment):
    ops, triton = _train(experiment, "ops", tmp_path), _train(experiment, "triton", tmp_path)
    assert [r["step"] for r in ops] == [r["step"] for r in triton] == list(range(1, 21))
    for a, b in zip(ops, triton):
        assert a.keys() == b.keys(), (a["step"], sorted(a.keys() ^ b.keys()))
        assert any(k.startswith("attn_dq_dterm_cos/") for k in a), a["step"]  # the mechanism statistics are logged
        assert abs(a["loss"] - b["loss"]) <= 1e-3 * abs(a["loss"]), (a["step"], a["loss"], b["loss"])
        counts = [k for k in a if k.startswith(("fp8_underflow/", "fp8_saturation/"))]
        assert counts and all(abs(a[k] - b[k]) <= 1e-3 * max(abs(a[k]), 1) for k in counts), a["step"]
        rowsums = [k for k in a if k.startswith("attn_rowsum/mean/")]
        assert rowsums and all(abs(a[k] - b[k]) <= 1e-4 * abs(a[k]) + 1e-12 for k in rowsums), a["step"]
