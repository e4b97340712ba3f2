"""Faults during a run, in-process on the toy model (``toys``): wandb crashing mid-run, preemption
signals and requeued Slurm jobs, and the checkpoint a resume needs; with the real ``train.py``:
tests/integration/test_faults.py."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import toys
from readback.train.checkpoint import list_checkpoints, load_checkpoint
from readback.train.preemption import Interrupted, Preempted, PreemptionGuard, exit_for_requeue, parse_signals
from readback.train.records.metrics import read_jsonl


def test_wandb_crash_mid_run_keeps_training_and_local_metrics(tmp_path, built, monkeypatch):
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
    cfg = toys.make_cfg(logger="wandb", **{"logger.mode": "offline", "logger.project": "t"})
    summary = toys.train(cfg, tmp_path)
    assert summary["status"] == "completed" and summary["steps"] == 12
    assert runs[0].logged == [2, 4]
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [2, 4, 6, 8, 10, 12]


def test_preemption_signal_in_process_checkpoints_and_resumes(tmp_path, built, monkeypatch):
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


def test_signal_on_the_last_step_just_completes(tmp_path, built, monkeypatch):
    real_next = toys.ToyStream.next_batch

    def next_batch(self):
        if self.calls == 45:  # step 12 of 12
            os.kill(os.getpid(), signal.SIGTERM)
        return real_next(self)

    monkeypatch.setattr(toys.ToyStream, "next_batch", next_batch)
    assert toys.train(toys.make_cfg(), tmp_path)["status"] == "completed"
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "completed"


def test_requeued_slurm_job_resumes_even_without_resume_flag(tmp_path, built, monkeypatch):
    with pytest.raises(RuntimeError, match="simulated crash"):
        toys.train(toys.make_cfg(), tmp_path, crash_at_call=40)
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


def test_checkpoint_holds_every_state_a_resume_needs(tmp_path, built):
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
    assert state["schedule"]["last_epoch"] == state["step"] == 12 and state["format"] == 3
    assert torch.is_tensor(rank["rng"]["torch"])


@pytest.mark.parametrize("scale", [1e-40, math.inf, 0.0])  # subnormal, infinite, zero in FP32
def test_an_unusable_scale_at_run_time_fails_the_run_naming_the_site(tmp_path, scale):
    """A scale no config check could see (planted in one site's delayed-scaling state) ends the
    run ``failed`` with the site named, at its first step, not ``diverged``."""
    from readback.backends import build_model
    from readback.errors import NumericsError
    from readback.train import Builders, run

    site = "layers.0.mlp.up.input"

    def planted(cfg, device):
        model = build_model(cfg, device)
        model.numerics.site(site).state.scale.fill_(scale)
        return model

    cfg = toys.config(*toys.TWO_STEP_RUN, "trainer.device=cpu")
    with pytest.raises(NumericsError, match=rf"site {site} was 0, subnormal, infinite or NaN in FP32 at step 1"):
        run(cfg, tmp_path, Builders(model=planted))
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["diverged_at_step"] is None
    assert summary["error"].startswith("NumericsError: the FP8 scale of site layers.0.mlp.up.input")


def test_ctrl_c_is_caught_once_and_a_second_one_stops_at_once():
    """SIGINT is a request whatever ``trainer.preempt_signals`` says; a second one raises."""
    before = signal.getsignal(signal.SIGINT)
    with PreemptionGuard([]) as guard:
        os.kill(os.getpid(), signal.SIGINT)
        assert guard.requested == signal.SIGINT and not guard.interrupted
        with pytest.raises(Interrupted):
            os.kill(os.getpid(), signal.SIGINT)
        assert guard.interrupted
    assert signal.getsignal(signal.SIGINT) == before
    with PreemptionGuard(["SIGTERM"]) as guard:  # a person's Ctrl-C after the scheduler's signal
        os.kill(os.getpid(), signal.SIGTERM)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)


def test_ctrl_c_exits_130_saying_how_to_continue_and_is_never_requeued(monkeypatch, capsys, tmp_path):
    requeued = []

    class SignalHandler:  # submitit's, which must not requeue a run a person stopped
        def checkpoint_and_try_requeue(self, signum, frame=None):
            requeued.append(signum)

    monkeypatch.delenv("SUBMITIT_PREEMPT_SIGNAL", raising=False)
    before = signal.signal(signal.SIGUSR2, SignalHandler().checkpoint_and_try_requeue)
    try:
        with pytest.raises(SystemExit) as info:
            exit_for_requeue(Preempted(signal.SIGINT, 7, f"{tmp_path}/checkpoints/step_0000007"), tmp_path)
    finally:
        signal.signal(signal.SIGUSR2, before)
    assert info.value.code == 130 and requeued == []
    assert capsys.readouterr().err.splitlines() == [
        f"SIGINT received: stopped after step 7, checkpoint {tmp_path}/checkpoints/step_0000007",
        f"continue it with: python train.py hydra.run.dir={tmp_path} trainer.resume=true",
    ]
    with pytest.raises(SystemExit):
        exit_for_requeue(Preempted(signal.SIGINT, 8, None, at_once=True), tmp_path)
    assert capsys.readouterr().err.splitlines() == [
        "SIGINT again: stopped at once after step 8; no checkpoint was written"
    ]


# A long program's loop: it writes each item whole (renamed into place), then works on the next one.
LONG_PROGRAM = """
import os, sys, time
from pathlib import Path
from readback.stopping import ends_on_ctrl_c

@ends_on_ctrl_c("long_program", "the items it finished are kept")
def main(out):
    for i in range(1000):
        Path(out, ".partial").write_text(f"item {i}\\n")
        os.replace(Path(out, ".partial"), Path(out, f"item{i}.txt"))
        time.sleep(0.05)

main(sys.argv[1])
"""


def test_a_long_program_ends_on_ctrl_c_in_one_line_keeping_what_it_finished(tmp_path):
    script = tmp_path / "long_program.py"
    script.write_text(LONG_PROGRAM)
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.Popen([sys.executable, str(script), str(out)], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while len(list(out.glob("item*"))) < 3:
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert err == "long_program: stopped by Ctrl-C; the items it finished are kept\n"
    finished = list(out.glob("item*"))
    assert len(finished) >= 3 and all(p.read_text() == f"item {p.stem[4:]}\n" for p in finished)
