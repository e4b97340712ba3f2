"""docs/te_backend.md's dry run of the 8B model under ``backend=te``, through the real ``python train.py``: it
runs on a machine without CUDA or Transformer Engine and prints the TE plan with the TE version
and GPU it assumed; without ``trainer.dry_run`` the same command is refused in one line."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys

import pytest
import torch

from toys import REPO

pytestmark = pytest.mark.integration
BARE = not torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is None
bare_machine = pytest.mark.skipif(not BARE, reason="checks what a machine without CUDA and TE assumes")


def readme_command() -> tuple[dict[str, str], list[str]]:
    """docs/te_backend.md's ``WORLD_SIZE=... python train.py ... backend=te ... trainer.dry_run=true`` line."""
    readme = (REPO / "docs/te_backend.md").read_text()
    line = next(
        line
        for line in readme.splitlines()
        if "python train.py" in line and "backend=te" in line and "trainer.dry_run=true" in line
    )
    words = shlex.split(line.split("#")[0])
    env = dict(w.split("=", 1) for w in words[: words.index("python")])
    return env, words[words.index("train.py") + 1 :]


def _train(args: list[str], env: dict[str, str], tmp_path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "train.py", *args, f"hydra.run.dir={tmp_path / 'run'}", "logger=none"],
        cwd=REPO,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


@bare_machine
def test_readmes_te_dry_run_prints_the_plan_and_its_assumptions(tmp_path):
    env, args = readme_command()
    assert env == {"WORLD_SIZE": "32"} and "model=fog_8b" in args and "trainer.parallel=fsdp" in args
    done = _train(args, env, tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    assert "backend=te plan for Transformer Engine 2.8.0 on sm90, cuDNN 9.13.0:" in out
    assumed = re.search(r"^  assumed: (.*)$", out, re.M)
    assert assumed is not None, out
    assert "Transformer Engine 2.8.0 (none installed here" in assumed[1]
    assert "GPU sm90 (H100, H200) with cuDNN 9.13.0 (no CUDA GPU here)" in assumed[1]
    assert "  TE recipe: DelayedScaling(margin=0, fp8_format=HYBRID, amax_history_len=1024" in out
    assert re.search(r"^  linear: te\.Linear", out, re.M) and re.search(r"^  norm: te\.RMSNorm$", out, re.M)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "dry_run" and summary["memory_gb"]["fsdp"]["world_size"] == 32
    plan = summary["te_plan"]
    assert (plan["te_version"], plan["gpu"], plan["assumed"]) == ("2.8.0", "sm90, cuDNN 9.13.0", ["te_version", "gpu"])
    assert plan["recipe"] == "DelayedScaling" and plan["sites"]["norm"] == "te.RMSNorm"


@bare_machine
def test_the_same_command_without_dry_run_is_refused_in_one_line(tmp_path):
    env, args = readme_command()
    done = _train([a for a in args if a != "trainer.dry_run=true"], env, tmp_path)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: backend='te' is not valid; valid: needs CUDA")
    assert not (tmp_path / "run").exists()


@bare_machine
def test_a_dry_run_the_assumed_gpu_cannot_run_is_refused_naming_it(tmp_path):
    """Head dim 64 under TE's FP8 attention: refused on the assumed sm90, in one line, exit 2."""
    done = _train(["+experiment=reuse_rounded", "model=small", "backend=te", "trainer.dry_run=true"], {}, tmp_path)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Transformer Engine 2.8.0 on sm90, cuDNN 9.13.0" in lines[0], lines
    assert "model.n_heads" in lines[0]
