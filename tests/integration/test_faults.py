"""Faults during a run: divergence (NaN/Inf loss or gradients), FP8 saturation, preemption
signals, and wandb failing in every way it can (no key, a bad key, no network, a crash mid-run).

End-to-end cases run the real ``train.py`` in subprocesses (tiny model, synthetic data); the rest
run ``readback.train.run`` in-process on the toy model of ``test_train_components.py``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from readback.train.checkpoint import list_checkpoints, load_checkpoint
from readback.train.metrics import read_jsonl
from readback.train.preemption import Preempted, PreemptionGuard, exit_for_requeue, parse_signals

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
TINY = [
    "data=synthetic",
    "data.n_tokens=65536",
    "model.n_layers=2",
    "model.d_model=32",
    "model.n_heads=2",
    "model.n_kv_groups=1",
    "model.ffn_dim=64",
    "model.seq_len=32",
    "model.global_batch=4",
    "trainer.micro_batch=2",
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
        cmd, cwd=ROOT, env=env or _env(WANDB_MODE="disabled"), capture_output=True, text=True, timeout=timeout
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


# --------------------------------------------------------------------------- in-process, toy model
def _toys():
    spec = importlib.util.spec_from_file_location("readback_train_toys", TESTS / "test_train_components.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def toys(monkeypatch):
    module = _toys()
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    module.BUILT.clear()
    return module


def test_wandb_crash_mid_run_keeps_training_and_local_metrics(tmp_path, toys, monkeypatch):
    import wandb

    class CrashingRun:
        """A run whose service dies at the third log call."""

        def __init__(self):
            self.logged, self.summary = [], {}

        def log(self, data, step):
            if len(self.logged) == 2:
                raise BrokenPipeError("wandb service died")
            self.logged.append(step)

        def finish(self, *args, **kwargs):
            raise BrokenPipeError("still dead")

    runs = []
    monkeypatch.setattr(wandb, "init", lambda **kwargs: runs.append(CrashingRun()) or runs[-1])
    cfg = toys.make_cfg()
    cfg.logger = OmegaConf.create({"name": "wandb", "mode": "offline", "project": "t", "entity": None, "tags": []})
    summary = toys.train(cfg, tmp_path)
    assert summary["status"] == "completed" and summary["steps"] == 12
    assert runs[0].logged == [2, 4]
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [2, 4, 6, 8, 10, 12]


def test_preemption_signal_in_process_checkpoints_and_resumes(tmp_path, toys, monkeypatch):
    """SIGUSR1 arrives during step 6 (between checkpoints): step 6 finishes, a checkpoint of step
    6 is written, no summary; resuming gives the uninterrupted curve."""
    straight, preempted = tmp_path / "straight", tmp_path / "preempted"
    toys.train(toys.make_cfg(), straight)
    toys.BUILT.clear()
    real_next = toys.ToyStream.next_batch

    def next_batch(self):
        if self.calls == 21:  # step 6 (4 micro-batches per step)
            os.kill(os.getpid(), signal.SIGUSR1)
        return real_next(self)

    monkeypatch.setattr(toys.ToyStream, "next_batch", next_batch)
    before = signal.getsignal(signal.SIGUSR1)
    with pytest.raises(Preempted) as info:
        toys.train(toys.make_cfg(), preempted)
    assert signal.getsignal(signal.SIGUSR1) == before  # handlers restored
    assert info.value.signum == signal.SIGUSR1 and info.value.step == 6 and info.value.exit_code == 138
    assert [s for s, _ in list_checkpoints(preempted / "checkpoints")] == [4, 6]
    assert not (preempted / "summary.json").exists()
    assert read_jsonl(preempted / "metrics.jsonl")[-1]["step"] == 6
    monkeypatch.setattr(toys.ToyStream, "next_batch", real_next)
    summary = toys.train(toys.make_cfg(**{"trainer.resume": True}), preempted)
    assert summary["status"] == "completed"
    assert read_jsonl(preempted / "metrics.jsonl") == [
        {**r, "tokens_per_s": read_jsonl(preempted / "metrics.jsonl")[i]["tokens_per_s"]}
        for i, r in enumerate(read_jsonl(straight / "metrics.jsonl"))
    ]


def test_signal_on_the_last_step_just_completes(tmp_path, toys, monkeypatch):
    real_next = toys.ToyStream.next_batch

    def next_batch(self):
        if self.calls == 45:  # step 12 of 12
            os.kill(os.getpid(), signal.SIGTERM)
        return real_next(self)

    monkeypatch.setattr(toys.ToyStream, "next_batch", next_batch)
    assert toys.train(toys.make_cfg(), tmp_path)["status"] == "completed"
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "completed"


def test_requeued_slurm_job_resumes_even_without_resume_flag(tmp_path, toys, monkeypatch):
    with pytest.raises(RuntimeError, match="simulated crash"):
        toys.train(toys.make_cfg(**{"data.crash_at_call": 40}), tmp_path)
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    summary = toys.train(toys.make_cfg(), tmp_path)  # trainer.resume=false, but a requeued job
    assert summary["status"] == "completed"
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [2, 4, 6, 8, 10, 12]


def test_exit_for_requeue_calls_submitits_handler(monkeypatch):
    """Under submitit the job is requeued by submitit's own handler of its preemption signal."""
    calls = []

    class SignalHandler:  # the shape of submitit.core.job_environment.SignalHandler
        def checkpoint_and_try_requeue(self, signum, frame=None):
            calls.append(signum)
            sys.exit(-1)

    monkeypatch.delenv("SUBMITIT_PREEMPT_SIGNAL", raising=False)
    before = signal.signal(signal.SIGUSR2, SignalHandler().checkpoint_and_try_requeue)
    try:
        with pytest.raises(SystemExit) as info:
            exit_for_requeue(Preempted(signal.SIGTERM, 7, "ckpt"))
        assert calls == [signal.SIGTERM] and info.value.code == -1
    finally:
        signal.signal(signal.SIGUSR2, before)
    with pytest.raises(SystemExit) as info:  # not under submitit: 128 + signal
        exit_for_requeue(Preempted(signal.SIGTERM, 7, "ckpt"))
    assert info.value.code == 143


def test_guard_parses_signals_and_restores_handlers():
    assert parse_signals(["SIGTERM", "usr1", int(signal.SIGUSR2), "SIGTERM"]) == [15, 10, 12]
    with pytest.raises(ValueError):
        parse_signals(["SIGFOO"])
    before = signal.getsignal(signal.SIGTERM)
    with PreemptionGuard(["SIGTERM"]) as guard:
        os.kill(os.getpid(), signal.SIGTERM)
        assert guard.requested == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) == before
    with PreemptionGuard([]) as guard:
        assert guard.requested is None


def test_checkpoint_holds_every_state_a_resume_needs(tmp_path, toys):
    toys.train(toys.make_cfg(), tmp_path)
    state = load_checkpoint(list_checkpoints(tmp_path / "checkpoints")[-1][1])
    assert {
        "model",
        "optimizer",
        "schedule",
        "step",
        "ranks",
        "divergence",
        "progress",
        "wandb_run_id",
        "config",
        "world_size",
    } <= state.keys()
    rank = state["ranks"][0]
    assert {"data", "numerics", "rng"} <= rank.keys()
    assert {"torch", "python", "numpy"} <= rank["rng"].keys()
    assert state["schedule"]["last_epoch"] == state["step"] == 12 and state["format"] == 2
    assert torch.is_tensor(rank["rng"]["torch"])
