"""Reproducible runs that survive faults, with the real ``train.py`` in subprocesses: the same
seed twice gives the same bits; a run killed with SIGKILL (at several moments, and in the middle
of a checkpoint save) or stopped by a preemption signal resumes with ``trainer.resume=true`` on
the uninterrupted run's curve, bit for bit, in the same ``metrics.jsonl`` and wandb run.

Every run uses the tiny model on synthetic data with stochastic forward rounding, the
``fresh_reround`` policy (an independent random stream per site) and a 2-repeat gradient probe
(salted streams), so every random stream of the run has to be restored for the curves to match.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from readback.train.checkpoint import list_checkpoints, load_checkpoint, verify
from readback.train.checkpoint.writer_lock import lock_path
from readback.train.records.metrics import read_jsonl
from toys import REPO, TOY_RUN

STEPS = 30
TINY = [
    "+experiment=fresh_reround",
    "precision.rounding=stochastic",
    "seed=7",
    "data=synthetic",
    "data.n_tokens=65536",
    "model.n_layers=2",
    *TOY_RUN,
    f"trainer.steps={STEPS}",
    "trainer.log_every=3",
    "trainer.eval_every=10",
    "trainer.eval_batches=1",
    "trainer.ckpt_every=4",
    "trainer.keep_last=2",
    "trainer.optim.warmup_steps=3",
    "trainer.progress=false",
    "probe.every=5",
    "probe.repeats=2",
    "logger=none",
]
# Logged steps: multiples of 3, eval steps (10, 20, 30) and probe steps (5, 10, ...). Checkpoints at
# multiples of 4 fall between logged steps, so the window of losses and the saturation counts not
# yet logged must travel in the checkpoint too.
LOGGED = sorted({s for s in range(1, STEPS + 1) if s % 3 == 0 or s % 10 == 0 or s % 5 == 0})
TIMING_KEYS = {"tokens_per_s", "mfu", "mem_gib"}  # wall-clock measurements, not results


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled", WANDB_SILENT="true")
    env.pop("WORLD_SIZE", None)
    env.pop("SLURM_RESTART_COUNT", None)
    env.update(extra)
    return env


def _start(run_dir: Path, *extra: str, env: dict[str, str] | None = None, script: str = "train.py") -> subprocess.Popen:
    cmd = [sys.executable, script, *TINY, *extra, f"hydra.run.dir={run_dir}"]
    return subprocess.Popen(cmd, cwd=REPO, env=env or _env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen, timeout: float = 240) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def _train(run_dir: Path, *extra: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    return _finish(_start(run_dir, *extra, env=env))


def _last_step(run_dir: Path) -> int:
    records = read_jsonl(run_dir / "metrics.jsonl")
    return records[-1]["step"] if records else 0


def _signal_when(proc: subprocess.Popen, run_dir: Path, sig: int, ready, timeout: float = 240) -> None:
    """Send ``sig`` to ``proc`` as soon as ``ready()`` holds; fail if the run ends first."""
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, f"the run ended before the signal: {proc.communicate()}"
        assert time.monotonic() < deadline, "timed out waiting for the kill point"
        time.sleep(0.003)
    proc.send_signal(sig)


def _results(run_dir: Path) -> list[dict]:
    """The metrics records without wall-clock measurements."""
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in read_jsonl(run_dir / "metrics.jsonl")]


def _assert_same_run(run_dir: Path, reference: Path) -> None:
    got, want = _results(run_dir), _results(reference)
    assert [r["step"] for r in got] == LOGGED  # appended: no duplicate, no missing step
    for g, w in zip(got, want, strict=True):
        assert g == w, {k: (g.get(k), w.get(k)) for k in set(g) | set(w) if g.get(k) != w.get(k)}
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == STEPS
    a = load_checkpoint(list_checkpoints(run_dir / "checkpoints")[-1][1])["model"]
    b = load_checkpoint(list_checkpoints(reference / "checkpoints")[-1][1])["model"]
    assert all(torch.equal(a[k], b[k]) for k in b)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The uninterrupted run, trained twice at the same time from the same config and seed."""
    root = tmp_path_factory.mktemp("reference")
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda d: _train(d), [root / "a", root / "b"]))
    for rc, _, err in results:
        assert rc == 0, err[-3000:]
    return root


def test_same_config_and_seed_give_identical_bits(reference):
    a, b = _results(reference / "a"), _results(reference / "b")
    assert a == b and [r["step"] for r in a] == LOGGED
    assert any(k.startswith("grad_error/bias/") for k in a[1])  # step 5: the probe's repeats ran
    assert any(k.startswith("fp8_saturation/") for r in a for k in r)
    assert len({r["loss"] for r in a}) == len(a)  # a real curve, not a constant


def test_sigkill_at_several_points_resumes_bit_exactly(tmp_path, reference):
    run_dir, ckpts = tmp_path / "run", tmp_path / "run" / "checkpoints"
    # 1: killed in the middle of training, metrics ahead of the last checkpoint
    proc = _start(run_dir)
    _signal_when(proc, run_dir, signal.SIGKILL, lambda: _last_step(run_dir) >= 9)
    assert _finish(proc)[0] == -signal.SIGKILL
    assert not (run_dir / "summary.json").exists()
    assert len(list_checkpoints(ckpts)) <= 2
    # 2: resumed, then killed right after a checkpoint appears
    proc = _start(run_dir, "trainer.resume=true")
    _signal_when(proc, run_dir, signal.SIGKILL, lambda: any(s >= 16 for s, _ in list_checkpoints(ckpts)))
    assert _finish(proc)[0] == -signal.SIGKILL
    # 3: resumed, then killed as soon as it logs its first step
    first = list_checkpoints(ckpts)[-1][0]
    proc = _start(run_dir, "trainer.resume=true")
    _signal_when(proc, run_dir, signal.SIGKILL, lambda: _last_step(run_dir) > first)
    assert _finish(proc)[0] == -signal.SIGKILL
    # 4: resumed to the end
    rc, _, err = _train(run_dir, "trainer.resume=true")
    assert rc == 0, err[-3000:]
    _assert_same_run(run_dir, reference / "a")
    assert [s for s, _ in list_checkpoints(ckpts)] == [28, 30]  # keep_last=2


def test_sigterm_and_sigusr1_checkpoint_exit_and_resume_in_the_same_wandb_run(tmp_path, reference):
    run_dir = tmp_path / "run"
    env = _env(WANDB_MODE="offline")
    wandb = ["logger=wandb", "logger.mode=offline"]
    for sig, when in ((signal.SIGTERM, 5), (signal.SIGUSR1, 15)):
        proc = _start(run_dir, *wandb, "trainer.resume=true", env=env)
        _signal_when(proc, run_dir, sig, lambda when=when: _last_step(run_dir) >= when)
        rc, out, err = _finish(proc)
        assert rc == 128 + sig, err[-3000:]
        assert f"{signal.Signals(sig).name} received" in err
        reached = list_checkpoints(run_dir / "checkpoints")[-1][0]  # saved at the step reached
        assert reached >= _last_step(run_dir) >= when
        assert f"stopped after step {reached}" in out
        assert not (run_dir / "summary.json").exists()  # the run is not over
    rc, _, err = _train(run_dir, *wandb, "trainer.resume=true", env=env)
    assert rc == 0, err[-3000:]
    _assert_same_run(run_dir, reference / "a")
    run_id = load_checkpoint(list_checkpoints(run_dir / "checkpoints")[-1][1])["wandb_run_id"]
    runs = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 3 and all(r.name.endswith(f"-{run_id}") for r in runs), runs


KILL_AT_SAVE = """
import os, runpy, signal, sys
from readback.train.checkpoint import manager

calls, commit = [0], manager.commit_checkpoint

def dying_commit(*args, **kwargs):  # the shards and the index are written, not yet renamed
    calls[0] += 1
    if calls[0] == int(os.environ["DIE_AT_SAVE"]):
        os.kill(os.getpid(), signal.SIGKILL)
    return commit(*args, **kwargs)

manager.commit_checkpoint = dying_commit
sys.argv = ["train.py"] + sys.argv[1:]
runpy.run_path("train.py", run_name="__main__")
"""


def test_sigkill_during_a_checkpoint_save_leaves_the_previous_one(tmp_path, reference):
    run_dir, ckpts = tmp_path / "run", tmp_path / "run" / "checkpoints"
    script = tmp_path / "kill_at_save.py"
    script.write_text(KILL_AT_SAVE)
    proc = subprocess.Popen(
        [sys.executable, str(script), *TINY, f"hydra.run.dir={run_dir}"],
        cwd=REPO,
        env=_env(DIE_AT_SAVE="3"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert _finish(proc)[0] == -signal.SIGKILL  # killed inside the third save (step 12)
    assert [s for s, _ in list_checkpoints(ckpts)] == [4, 8]
    torn = ckpts / ".step_0000012.tmp"  # written in full, never under a checkpoint name
    assert sorted(p.name for p in torn.iterdir()) == [".metadata", "__0_0.distcp", "__0_checksums.json"]
    assert load_checkpoint(list_checkpoints(ckpts)[-1][1])["step"] == 8
    rc, _, err = _train(run_dir, "trainer.resume=true")
    assert rc == 0, err[-3000:]
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_0000028", "step_0000030"]  # temp directory gone
    _assert_same_run(run_dir, reference / "a")


def _step_of(tmp: Path) -> int:
    return int(tmp.name.removeprefix(".step_").removesuffix(".tmp"))


def _newest_save(ckpts: Path, after: int) -> Path | None:
    """The temporary directory of the newest save in flight of a step after ``after``, if any."""
    found = sorted(p for p in ckpts.glob(".step_*.tmp") if _step_of(p) > after)
    return found[-1] if found else None


# The instants of a save at which a run is killed, each found by polling what the save has
# written so far (the kill lands at once, or a little later: both are instants of a save).
SAVE_INSTANTS = {
    "save_begun": lambda tmp: True,
    "shard_written": lambda tmp: (tmp / "__0_0.distcp").exists(),
    "checksums_written": lambda tmp: (tmp / "__0_checksums.json").exists(),
    "index_written": lambda tmp: (tmp / ".metadata").exists(),
}


# A save held 50 ms at each of the instants above, so that a poll of the run directory finds each
# one on a loaded machine too: the kill still comes from outside, at whatever the save has reached.
HELD_SAVES = """
import runpy, sys, time
from torch.distributed.checkpoint import FileSystemWriter
from readback.train.checkpoint import io, manager

def held(function):
    def after_a_hold(*args, **kwargs):
        time.sleep(0.05)
        return function(*args, **kwargs)
    return after_a_hold

io._ChecksummedWriter.write_data = held(io._ChecksummedWriter.write_data)  # the directory made, empty
io.crc32_of = held(io.crc32_of)  # the shard written, its checksums not yet
io._ChecksummedWriter.finish = held(FileSystemWriter.finish)  # the checksums written, the index not yet
manager.commit_checkpoint = held(manager.commit_checkpoint)  # the index written, not yet renamed
sys.argv = ["train.py"] + sys.argv[1:]
runpy.run_path("train.py", run_name="__main__")
"""


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_sigkill_at_any_instant_of_a_save_resumes_from_the_newest_complete_checkpoint(
    tmp_path, reference, asynchronous
):
    """A checkpoint every step; each attempt is killed at one instant of a save (a temporary
    directory just made, its shard, its checksums, its index written but not committed) or just
    after a commit, before the next log line; each resume starts from the newest complete
    checkpoint. The run then ends on the uninterrupted run's records, step for step."""
    run_dir, ckpts = tmp_path / "run", tmp_path / "run" / "checkpoints"
    extra = ["trainer.resume=true", "trainer.ckpt_every=1", f"trainer.ckpt_async={str(asynchronous).lower()}"]
    instants = {
        **{name: functools.partial(_save_reached, ckpts, test) for name, test in SAVE_INSTANTS.items()},
        "between_checkpoint_and_log": lambda after: (
            any(s > max(after, _last_step(run_dir)) for s, _ in list_checkpoints(ckpts)) and _last_step(run_dir) > after
        ),
    }
    held = tmp_path / "held_saves.py"
    held.write_text(HELD_SAVES)
    left_mid_save = []
    for name, reached in instants.items():
        # past the newest checkpoint and any save the last kill left unfinished (cleared on resume)
        start = max(
            [s for s, _ in list_checkpoints(ckpts)] + [_step_of(p) for p in ckpts.glob(".step_*.tmp")], default=0
        )
        proc = _start(run_dir, *extra, script=str(held))
        _signal_when(proc, run_dir, signal.SIGKILL, lambda reached=reached, start=start: reached(start))
        assert _finish(proc)[0] == -signal.SIGKILL, name
        assert lock_path(run_dir).exists()  # the killed run's lock, which must not block the resume
        left_mid_save += [name] if any(ckpts.glob(".step_*.tmp")) else []
        assert all((path / ".metadata").is_file() for _, path in list_checkpoints(ckpts)), name
    rc, _, err = _train(run_dir, *extra)
    assert rc == 0, err[-3000:]
    _assert_same_run(run_dir, reference / "a")
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_0000029", "step_0000030"]  # no temporary left
    assert not lock_path(run_dir).exists()
    assert left_mid_save, "no kill landed inside a save"


def _save_reached(ckpts: Path, test, after: int) -> bool:
    tmp = _newest_save(ckpts, after)
    return tmp is not None and test(tmp)


def test_a_second_writer_is_refused_and_a_killed_one_never_blocks(tmp_path, reference):
    """Two ``train.py`` on one run directory: the second refuses at start in one line naming the
    first (host, pid); the first, killed, leaves its lock, and the next resume takes it over."""
    run_dir = tmp_path / "run"
    first = _start(run_dir, "trainer.resume=true")
    _signal_when(first, run_dir, signal.SIGSTOP, lambda: _last_step(run_dir) >= 3)  # alive, holding the lock
    try:
        rc, out, err = _train(run_dir, "trainer.resume=true")
        assert rc == 2 and err.splitlines() == [err.strip()] and "Traceback" not in out + err, err[-3000:]
        assert err.startswith(f"error: hydra.run.dir='{run_dir}' is not valid; valid: a run directory no other")
        assert f"host {socket.gethostname()}, pid {first.pid} holds it" in err
    finally:
        first.kill()
    first.communicate()
    assert lock_path(run_dir).exists()
    rc, out, err = _train(run_dir, "trainer.resume=true")
    assert rc == 0, err[-3000:]
    assert f"pid {first.pid} is not running" in out + err
    _assert_same_run(run_dir, reference / "a")
    assert not lock_path(run_dir).exists()


def _stderr_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.strip()]


def test_ctrl_c_saves_after_the_step_says_how_to_continue_and_resumes_on_the_curve(tmp_path, reference):
    """Ctrl-C (SIGINT) between checkpoints: the step finishes, a checkpoint of it is written, two
    lines say where and how to continue, exit 130, no traceback; the command they give, alone,
    continues the run under its own settings, on the uninterrupted run's records."""
    run_dir = tmp_path / "run"
    proc = _start(run_dir)
    _signal_when(proc, run_dir, signal.SIGINT, lambda: _last_step(run_dir) >= 5)
    rc, out, err = _finish(proc)
    reached = list_checkpoints(run_dir / "checkpoints")[-1][0]
    assert rc == 130 and "Traceback" not in out + err, err[-3000:]
    assert _stderr_lines(err) == [
        "Ctrl-C (SIGINT) received: saving a checkpoint after this step; Ctrl-C again stops at once, "
        "keeping the newest complete checkpoint",
        f"SIGINT received: stopped after step {reached}, checkpoint {run_dir}/checkpoints/step_{reached:07d}",
        f"continue it with: python train.py hydra.run.dir={run_dir} trainer.resume=true",
    ]
    assert reached >= _last_step(run_dir) >= 5 and not (run_dir / "summary.json").exists()
    continued = [sys.executable, "train.py", f"hydra.run.dir={run_dir}", "trainer.resume=true"]  # the line's command
    done = subprocess.run(continued, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "default changed" not in done.stdout + done.stderr  # the run's settings are its own
    _assert_same_run(run_dir, reference / "a")
    overrides = (run_dir / ".hydra" / "overrides.yaml").read_text().splitlines()
    assert overrides == [f"- {o}" for o in TINY] + ["- trainer.resume=true"]  # the run's command line, resumed


# Commits of the steps from HOLD_FROM on are held HOLD_S seconds: the index is written, the
# checkpoint not yet renamed onto its name, when the second Ctrl-C comes.
HELD_COMMITS = """
import os, runpy, sys, time
from readback.train.checkpoint import manager

commit = manager.commit_checkpoint

def held_commit(ckpt_dir, step, *args, **kwargs):
    if step >= int(os.environ["HOLD_FROM"]):
        time.sleep(float(os.environ["HOLD_S"]))
    return commit(ckpt_dir, step, *args, **kwargs)

manager.commit_checkpoint = held_commit
sys.argv = ["train.py"] + sys.argv[1:]
runpy.run_path("train.py", run_name="__main__")
"""


def test_a_second_ctrl_c_during_the_save_stops_at_once_keeping_the_newest_checkpoint(tmp_path, reference):
    run_dir, ckpts = tmp_path / "run", tmp_path / "run" / "checkpoints"
    script = tmp_path / "held_commits.py"
    script.write_text(HELD_COMMITS)
    proc = _start(run_dir, env=_env(HOLD_FROM="5", HOLD_S="60"), script=str(script))
    _signal_when(proc, run_dir, signal.SIGINT, lambda: _last_step(run_dir) >= 5)
    _signal_when(
        proc, run_dir, signal.SIGINT, lambda: any((p / ".metadata").exists() for p in ckpts.glob(".step_*.tmp"))
    )
    sent = time.monotonic()
    rc, out, err = _finish(proc)
    assert time.monotonic() - sent < 30, "the second Ctrl-C did not stop the held save"
    assert rc == 130 and "Traceback" not in out + err, err[-3000:]
    assert [s for s, _ in list_checkpoints(ckpts)] == [4]  # the newest complete checkpoint, whole
    verify(list_checkpoints(ckpts)[-1][1])
    torn = next(ckpts.glob(".step_*.tmp"))
    assert _stderr_lines(err)[1:] == [
        f"SIGINT again: stopped at once after step {_step_of(torn)}; "
        f"the newest complete checkpoint is {ckpts}/step_0000004",
        f"continue it with: python train.py hydra.run.dir={run_dir} trainer.resume=true",
    ]
    assert not (run_dir / "summary.json").exists()
    rc, _, err = _train(run_dir, "trainer.resume=true")
    assert rc == 0, err[-3000:]
    assert not list(ckpts.glob(".step_*.tmp"))
    _assert_same_run(run_dir, reference / "a")
