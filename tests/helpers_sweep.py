"""A real tiny sweep made once per test session with the actual ``train.py`` (shared by
test_analysis.py and test_notebook.py; import ``real_sweep`` and call it with
``tmp_path_factory``)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXPERIMENTS = ("reuse_rounded", "no_saved_copy")
# 2 experiments x 1 seed, 10 steps of a narrowed tiny FOG (2 layers) on synthetic data; probe
# steps 5 and 10 with 2 repeats (bias and noise); ~10 s per run on a busy 2-core machine.
OVERRIDES = (
    "-m", f"+experiment={','.join(EXPERIMENTS)}", "seed=0", "model=tiny", "data=synthetic", "logger=none",
    "trainer.steps=10", "trainer.log_every=5", "trainer.eval_every=5", "trainer.eval_batches=1",
    "trainer.progress=false", "probe.every=5", "probe.repeats=2",
    "model.d_model=32", "model.n_heads=2", "model.n_kv_groups=1", "model.ffn_dim=96", "model.seq_len=32",
    "model.global_batch=4", "trainer.micro_batch=4", "data.n_tokens=32768",
)

_cache: dict[str, object] = {}


def real_sweep(tmp_path_factory) -> Path:
    """The sweep directory (``<experiment>/seed0/<job>/`` run dirs); made on first call."""
    if "dir" not in _cache:
        base = tmp_path_factory.mktemp("real_sweep")
        out = base / "sweep"
        env = {**os.environ, "WANDB_MODE": "disabled", "HYDRA_FULL_ERROR": "1"}
        cmd = [sys.executable, str(REPO / "train.py"), *OVERRIDES, f"hydra.sweep.dir={out}"]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=base, env=env, capture_output=True, text=True, timeout=600)
        _cache["seconds"] = time.perf_counter() - t0
        if proc.returncode != 0:
            raise AssertionError(f"train.py sweep failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
        _cache["dir"] = out
    return _cache["dir"]  # type: ignore[return-value]


def sweep_seconds() -> float | None:
    """Wall time of the sweep made by :func:`real_sweep` in this session (None if not made)."""
    return _cache.get("seconds")  # type: ignore[return-value]
