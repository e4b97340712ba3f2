"""Sweep directories for the analysis tests: hand-written run dirs, and a real tiny sweep made
with the actual ``train.py`` (``make_sweep``; the session fixture ``real_sweep`` of conftest.py
makes it once for test_analysis_sweeps.py, test_notebook.py, test_tracking.py and
test_report_browser.py).

Hand-written run dirs (config.yaml / metrics.jsonl / summary.json) cover completed, diverged,
failed-without-summary, failed-with-summary and running runs.

The real sweep: 2 experiments x 2 seeds, 10 steps of a narrowed tiny FOG (2 layers) on synthetic
data, wandb offline into each run directory; probe steps 5 and 10 with 2 repeats (bias and
noise). The fixed settings live in a sweep preset (``+sweep=test_tiny``, like
``conf/sweep/cpu_mini.yaml``) on an extra config search path, so the run folders are named by
the swept overrides only (``<experiment>/seed=<N>``). About 10 s per run on a busy 2-core machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from toys import REPO

EXPERIMENTS = ("reuse_rounded", "no_saved_copy")
SEEDS = (0, 1)
STEPS = 10
PRESET = """# @package _global_
defaults:
  - override /model: tiny
  - override /data: synthetic
trainer: {steps: 10, log_every: 5, eval_every: 5, eval_batches: 1, micro_batch: 4}
probe: {every: 5, repeats: 2}
model: {d_model: 32, n_heads: 2, n_kv_groups: 1, ffn_dim: 96, seq_len: 32, global_batch: 4}
data: {n_tokens: 32768}
"""


def sweep_args(conf_dir: Path, sweep_dir: Path, seeds: tuple[int, ...] = SEEDS) -> list[str]:
    """The command line of the test sweep (``train.py`` arguments)."""
    return [
        "-m",
        f"+experiment={','.join(EXPERIMENTS)}",
        f"seed={','.join(map(str, seeds))}",
        "+sweep=test_tiny",
        "logger=wandb",
        "logger.mode=offline",
        "logger.project=readback-tests",
        "logger.tags=[ci]",
        "trainer.resume=true",
        "trainer.progress=false",
        f"hydra.searchpath=[file://{conf_dir}]",
        f"hydra.sweep.dir={sweep_dir}",
    ]


def run_train(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "HYDRA_FULL_ERROR": "1"}
    env.pop("WANDB_DISABLED", None)
    proc = subprocess.run(
        [sys.executable, str(REPO / "train.py"), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=900
    )
    if proc.returncode != 0:
        raise AssertionError(f"train.py failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return proc


@dataclass(frozen=True)
class Sweep:
    """A real sweep: its directory (``<experiment>/seed=<N>/`` run dirs) and the config search
    path holding its preset (to extend it with the same settings)."""

    dir: Path
    conf: Path


def make_sweep(base: Path) -> Sweep:
    """Runs the test sweep under ``base`` (the preset in ``base/conf``, the runs in ``base/sweep``)."""
    conf = base / "conf"
    (conf / "sweep").mkdir(parents=True)
    (conf / "sweep" / "test_tiny.yaml").write_text(PRESET)
    out = base / "sweep"
    run_train(sweep_args(conf, out), cwd=base)
    return Sweep(dir=out, conf=conf)


def is_png(path: Path) -> bool:
    return path.is_file() and path.stat().st_size > 1000 and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


TOKENS_PER_STEP = 100
OLD = time.time() - 7 * 24 * 3600  # a week ago: a run without summary this old has failed


def config(experiment: str, seed: int, rounding: str = "nearest", policy: str | None = None, bwd: str = "fp8") -> dict:
    return {
        "model": {"name": "tiny", "n_layers": 2},
        "precision": {"name": "fp8", "rounding": rounding},
        "policy": {"name": policy or experiment},
        "attention": {"bwd_precision": bwd},
        "experiment": experiment,
        "seed": seed,
    }


def records(losses, *, probe_every: int = 20, eval_every: int = 20, every: int = 10, shift: float = 0.0) -> list[dict]:
    """One record per logged step with the keys the trainer writes (a subset of sites)."""
    out = []
    for i, loss in enumerate(losses):
        step = (i + 1) * every
        r = {
            "step": step,
            "loss": loss,
            "lr": 1e-3,
            "tokens": step * TOKENS_PER_STEP,
            "grad_norm": 1.0,
            "tokens_per_s": 1000.0,
            "kurtosis/attn_out_max": 3.0 + i + shift,
            "kurtosis/ffn_in_max": 3.5 + i,
            "attn_rowsum/mean/layers.0.attn.core": -1e-8 * i,
            "attn_rowsum/z/layers.0.attn.core": -float(i) - shift,
            "attn_rowsum/mean/layers.1.attn.core": 1e-9,
            "attn_rowsum/z/layers.1.attn.core": 0.5,
            "fp8_saturation/layers.0.attn.core.output": i,
        }
        if step % eval_every == 0:
            r["val_loss"] = None if loss is None else loss - 0.1
        if step % probe_every == 0:
            for name, scale in (("total", 1.0), ("layers.0.attn.core.dq", 2.0), ("layers.1.attn.core.dq", 3.0)):
                r[f"grad_error/rel_err/{name}"] = 0.01 * scale * (1 + shift)
                r[f"grad_error/cosine/{name}"] = 0.999
                r[f"grad_error/bias/{name}"] = 0.002 * scale * (1 + shift)
                r[f"grad_error/noise/{name}"] = 0.004 * scale
                r[f"grad_error_se/bias/{name}"] = 0.001 * scale
        out.append(r)
    return out


def summary(status: str, final_loss, val_loss, steps: int, experiment: str, diverged_at=None, **extra) -> dict:
    return {
        "status": status,
        "final_loss": final_loss,
        "val_loss": val_loss,
        "steps": steps,
        "tokens": steps * TOKENS_PER_STEP,
        "diverged_at_step": diverged_at,
        "divergence_reason": None,
        "skipped_updates": [],
        "wall_time_s": 12.5,
        "n_params": 1234,
        "experiment": experiment,
        **extra,
    }


def write_run(
    root: Path,
    rel: str,
    cfg: dict | None,
    recs: list[dict] | None,
    summ: dict | None,
    *,
    extra_lines: str = "",
    mtime: float | None = OLD,
) -> Path:
    d = root / rel
    (d / ".hydra").mkdir(parents=True, exist_ok=True)
    if cfg is not None:
        (d / ".hydra" / "config.yaml").write_text(yaml.safe_dump(cfg))
    if recs is not None:
        with open(d / "metrics.jsonl", "w") as f:
            for r in recs:
                f.write(json.dumps(r) + "\n")
            f.write(extra_lines)
    if summ is not None:
        (d / "summary.json").write_text(json.dumps(summ, indent=2))
    (d / "checkpoints").mkdir(exist_ok=True)
    (d / "checkpoints" / "summary.json").write_text("{}")  # below a run dir: must not be found as a run
    if mtime is not None:
        for p in [d, d / ".hydra", d / "checkpoints", *d.glob("*"), *(d / ".hydra").glob("*")]:
            os.utime(p, (mtime, mtime))
    return d


# final losses of the hand-written study (independent of the code under test)
REUSE_FINAL = [7.3, 7.5]
REUSE_VAL = [7.2, 7.4]
CONTROL_FINAL = [3.25, 3.26]
CONTROL_VAL = [3.15, 3.17]


def write_study(root: Path) -> Path:
    """Seven run dirs under ``root`` that cover every status the analysis reads."""
    # reuse_rounded: one completed (high loss), one diverged at step 30 with a NaN loss logged
    # (null in JSON) and a truncated last line
    write_run(
        root,
        "reuse_rounded/seed0/0",
        config("reuse_rounded", 0),
        records([5.0, 4.0, 6.0, 7.0, 7.3], shift=1.0),
        summary("completed", REUSE_FINAL[0], REUSE_VAL[0], 50, "reuse_rounded"),
    )
    write_run(
        root,
        "reuse_rounded/seed1/1",
        config("reuse_rounded", 1),
        records([5.0, 4.1, 9.0, None, 7.5], shift=1.0),
        summary("diverged", REUSE_FINAL[1], REUSE_VAL[1], 50, "reuse_rounded", diverged_at=30),
        extra_lines='{"step": 60, "loss": 7.',
    )
    # no_saved_copy: two completed, one killed (no summary; its files are old) after 2 records
    write_run(
        root,
        "no_saved_copy/seed0/2",
        config("no_saved_copy", 0),
        records([5.0, 4.0, 3.6, 3.4, 3.25]),
        summary("completed", CONTROL_FINAL[0], CONTROL_VAL[0], 50, "no_saved_copy"),
    )
    write_run(
        root,
        "no_saved_copy/seed1/3",
        config("no_saved_copy", 1),
        records([5.0, 4.0, 3.6, 3.4, 3.26]),
        summary("completed", CONTROL_FINAL[1], CONTROL_VAL[1], 50, "no_saved_copy"),
    )
    write_run(root, "no_saved_copy/seed2/4", config("no_saved_copy", 2), records([5.1, 4.2]), None)
    # fresh_reround: one failed with a summary (an exception), one still running (fresh files);
    # the running one has no config: experiment and seed come from the path
    write_run(
        root,
        "fresh_reround/seed0/5",
        config("fresh_reround", 0),
        records([5.0]),
        summary("failed", 5.0, None, 10, "fresh_reround", error="RuntimeError: boom"),
    )
    write_run(root, "fresh_reround/seed1/6", None, records([5.0, 4.5]), None, mtime=None)
    return root
