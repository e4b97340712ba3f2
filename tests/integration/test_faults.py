"""Faults during a run: divergence (NaN/Inf loss or gradients), FP8 saturation, preemption
signals, and wandb failing in every way it can (no key, a bad key, no network, a crash mid-run).

These cases run the real ``train.py`` in subprocesses (tiny model, synthetic data); the in-process
cases on the toy model are in tests/unit/train/test_faults.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from readback.train.checkpoint import list_checkpoints, load_checkpoint
from readback.train.records.metrics import read_jsonl
from toys import REPO, TOY_RUN

TINY = [
    "data=synthetic",
    "data.n_tokens=65536",
    "model.n_layers=2",
    *TOY_RUN,
    "trainer.steps=6",
    "trainer.log_every=1",
    "trainer.eval_every=6",
    "trainer.eval_batches=1",
    "trainer.ckpt_every=3",
    "trainer.progress=false",
]


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_SILENT="true")
    for key in ("WORLD_SIZE", "SLURM_RESTART_COUNT", "WANDB_MODE", "WANDB_API_KEY", "WANDB_DISABLED"):
        env.pop(key, None)
    env.update(extra)
    return env


def _train(
    *args: str, env: dict[str, str] | None = None, multirun: bool = False, timeout: float = 240
) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "train.py", *(["-m"] if multirun else []), *TINY, *args]
    return subprocess.run(
        cmd, cwd=REPO, env=env or _env(WANDB_MODE="disabled"), capture_output=True, text=True, timeout=timeout
    )


# --------------------------------------------------------------------------- divergence, end to end
def test_nan_run_is_diverged_exits_0_and_the_sweep_goes_on(tmp_path):
    """A multirun whose first job blows up (LR 1e30: FP8 saturates, then the loss is NaN) and
    whose second job trains: the sweep runs both, and exits 0."""
    sweep = tmp_path / "sweep"
    proc = _train(
        "model.lr=1e30,3e-3",
        "trainer.optim.warmup_steps=0",
        "trainer.optim.grad_clip=0",
        "+experiment=fresh_reround",
        "logger=none",
        f"hydra.sweep.dir={sweep}",
        "hydra.sweep.subdir=${hydra.job.num}",
        multirun=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    diverged = json.loads((sweep / "0" / "summary.json").read_text())
    assert diverged["status"] == "diverged" and diverged["diverged_at_step"] == diverged["steps"] <= 3
    assert diverged["nonfinite_tensors"][0] == "loss" and "non-finite loss" in diverged["divergence_reason"]
    assert any(t.endswith(".grad") for t in diverged["nonfinite_tensors"])
    records = read_jsonl(sweep / "0" / "metrics.jsonl")
    last = records[-1]
    assert last["step"] == diverged["diverged_at_step"] and last["diverged"] is True and last["loss"] is None
    saturated = {k: v for k, v in last.items() if k.startswith("fp8_saturation/")}
    assert saturated and all(isinstance(v, int) and v > 0 for v in saturated.values())  # the diagnosis
    # no checkpoint of the diverged step: the newest is the last finite one
    assert all(s < diverged["diverged_at_step"] for s, _ in list_checkpoints(sweep / "0" / "checkpoints"))
    completed = json.loads((sweep / "1" / "summary.json").read_text())
    assert completed["status"] == "completed" and completed["steps"] == 6


def test_a_bad_job_in_a_sweep_is_one_line_and_the_sweep_goes_on(tmp_path):
    sweep = tmp_path / "sweep"
    proc = _train(
        "trainer.steps=0,2",
        "logger=none",
        f"hydra.sweep.dir={sweep}",
        "hydra.sweep.subdir=${hydra.job.num}",
        multirun=True,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: trainer.steps=0 is not valid; valid: an integer >= 1"]
    assert "Traceback" not in proc.stderr
    assert not (sweep / "0").exists()  # the bad job left nothing
    assert json.loads((sweep / "1" / "summary.json").read_text())["status"] == "completed"


# --------------------------------------------------------------------------- wandb, end to end
WANDB_CASES = {
    # no key anywhere, mode auto: offline into the run dir
    "no_key": ({"HOME": "{tmp}", "NETRC": "{tmp}/netrc"}, ["logger.mode=auto"]),
    # a malformed key, online asked: wandb refuses it, offline instead
    "bad_key": ({"WANDB_API_KEY": "bad"}, ["logger.mode=online"]),
    # a well-formed key but no server to reach: online times out, offline under the same run id
    "no_network": (
        {"WANDB_API_KEY": "0123456789" * 4, "WANDB_BASE_URL": "http://127.0.0.1:9"},
        ["logger.mode=online", "logger.init_timeout=3"],
    ),
}


@pytest.mark.parametrize("cases", [sorted(WANDB_CASES)])
def test_wandb_never_stops_training_nor_loses_metrics(tmp_path, cases):
    def one(name):
        env_extra, args = WANDB_CASES[name]
        env = _env(**{k: v.format(tmp=tmp_path) for k, v in env_extra.items()})
        run_dir = tmp_path / name
        return name, run_dir, _train("logger=wandb", *args, f"hydra.run.dir={run_dir}", env=env)

    with ThreadPoolExecutor(len(cases)) as pool:
        results = list(pool.map(one, cases))
    for name, run_dir, proc in results:
        assert proc.returncode == 0, (name, proc.stderr[-3000:])
        assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6], name
        assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed", name
        run_id = load_checkpoint(list_checkpoints(run_dir / "checkpoints")[-1][1])["wandb_run_id"]
        offline = list((run_dir / "wandb").glob(f"offline-run-*-{run_id}"))
        assert len(offline) == 1, (name, list((run_dir / "wandb").iterdir()))
