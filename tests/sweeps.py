"""A real tiny sweep made once per test session with the actual ``train.py`` (shared by
test_analysis.py, test_notebook.py, test_tracking.py and test_report.py; call ``real_sweep``
with ``tmp_path_factory``).

2 experiments x 2 seeds, 10 steps of a narrowed tiny FOG (2 layers) on synthetic data, wandb
offline into each run directory; probe steps 5 and 10 with 2 repeats (bias and noise). The fixed
settings live in a sweep preset (``+sweep=test_tiny``, like ``conf/sweep/cpu_mini.yaml``) on an
extra config search path, so the run folders are named by the swept overrides only
(``<experiment>/seed=<N>``). About 10 s per run on a busy 2-core machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
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

_cache: dict[str, object] = {}


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


def real_sweep(tmp_path_factory) -> Path:
    """The sweep directory (``<experiment>/seed=<N>/`` run dirs); made on first call."""
    if "dir" not in _cache:
        base = tmp_path_factory.mktemp("real_sweep")
        conf = base / "conf"
        (conf / "sweep").mkdir(parents=True)
        (conf / "sweep" / "test_tiny.yaml").write_text(PRESET)
        out = base / "sweep"
        t0 = time.perf_counter()
        run_train(sweep_args(conf, out), cwd=base)
        _cache["seconds"] = time.perf_counter() - t0
        _cache["dir"], _cache["conf"] = out, conf
    return _cache["dir"]  # type: ignore[return-value]


def real_sweep_conf() -> Path:
    """The config search path of :func:`real_sweep` (call that first)."""
    return _cache["conf"]  # type: ignore[return-value]


def sweep_seconds() -> float | None:
    """Wall time of the sweep made by :func:`real_sweep` in this session (None if not made)."""
    return _cache.get("seconds")  # type: ignore[return-value]
