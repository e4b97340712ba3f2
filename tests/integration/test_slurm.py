"""Sweeps through a real single-node Slurm cluster (``hydra/launcher=slurm``).

The cluster (munged, slurmctld, slurmd; ``scripts/slurm/start.sh``) lives in a temporary
directory for this module and is stopped by PID at the end, also when a test fails. One multirun
of the tiny model on synthetic data submits two experiments as a Slurm job array; every job runs
two tasks, i.e. a two-rank torch.distributed (gloo) FSDP2 run set up from the Slurm environment. Job 0
is preempted (USR2, what Slurm sends before a time limit or preemption) after its first
checkpoint: submitit requeues it, and the requeued job resumes from that checkpoint. With no
accounting daemon, submitit reads job states through ``scripts/slurm/bin/sacct``.

Skipped when the Slurm daemons are not installed (Debian: ``slurmctld slurmd slurm-client
munge``), unless ``READBACK_REQUIRE_SLURM=1`` (CI), which turns the skip into a failure.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from readback.train.checkpoint import list_checkpoints
from toys import REPO, compose

pytestmark = pytest.mark.distributed  # process groups on local ports: one such module at a time

SCRIPTS = REPO / "scripts" / "slurm"
SBIN = os.pathsep.join(["/usr/sbin", "/sbin"])
COMMANDS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "squeue", "scancel")

STEPS = 20  # steps of each run
CKPT_EVERY = 2  # job 0 is preempted once its first checkpoint exists
EXPERIMENTS = ("reuse_rounded", "no_saved_copy")
TASKS = 2  # ranks per job
SWEEP_TIMEOUT_S = 150
CREDENTIAL_REVOKE_S = 2.5  # a requeued job starts this long after it was killed


def _launcher(*overrides: str) -> dict:
    from omegaconf import OmegaConf

    cfg = compose("+experiment=reuse_rounded", *overrides, return_hydra_config=True)
    return OmegaConf.to_container(cfg.hydra.launcher, resolve=True)


def test_slurm_launcher_config():
    launcher = _launcher("hydra/launcher=slurm")
    assert launcher["_target_"].endswith("SlurmLauncher")
    assert launcher["gpus_per_node"] == launcher["tasks_per_node"] == 8  # one rank per GPU
    assert launcher["nodes"] == 1 and launcher["max_num_timeout"] > 0
    four_nodes = _launcher("hydra/launcher=slurm", "hydra.launcher.nodes=4")
    assert four_nodes["nodes"] * four_nodes["tasks_per_node"] == 32  # ranks of the job
    assert launcher["submitit_folder"].endswith("/.submitit/%j")
    four = _launcher("hydra/launcher=slurm", "hydra.launcher.gpus_per_node=4", "hydra.launcher.partition=gpu")
    assert four["gpus_per_node"] == four["tasks_per_node"] == 4 and four["partition"] == "gpu"
    local = _launcher("hydra/launcher=local")
    assert local["_target_"].endswith("LocalLauncher") and local["tasks_per_node"] == 1


# Sweeps that train one run at a time, each arm branching from the base run's checkpoint
# (docs/results/d_term/preregistration_bf16_fix_cost.md), rather than one multirun.
ONE_RUN_AT_A_TIME = {"bf16_fix_cost.sh"}


def _a_base_run_to_branch_from(root: Path) -> dict[str, str]:
    """The environment that points bf16_fix_cost.sh at ``root`` with one seed whose base run
    has the step-1,500 checkpoint its branches copy."""
    base = root / "R" / "seed=700"
    (base / "checkpoints" / "step_0001500").mkdir(parents=True)
    (base / "metrics.jsonl").write_text("")
    return {"SWEEP_DIR": str(root), "SEEDS": "700"}


def test_sweeps_have_own_dirs_and_resume(tmp_path):
    """Every sweep file writes into its own hydra.sweep.dir (a script that runs several
    multiruns, one per shape, keeps them all under one folder of its own) and resumes requeued or
    rerun jobs (read from the arguments each script really passes to train.py)."""
    echo = tmp_path / "echo_args"
    echo.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    echo.chmod(0o755)
    dirs = {}
    for script in sorted((REPO / "sweeps").glob("*.sh")):
        env = {**os.environ, "PYTHON": str(echo)}
        if script.name in ONE_RUN_AT_A_TIME:
            env |= _a_base_run_to_branch_from(tmp_path / script.stem)
        args = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, check=True).stdout
        args = args.splitlines()
        if script.name in ONE_RUN_AT_A_TIME:  # each run in its own hydra.run.dir, resumed when run again
            runs = [a.split("=", 1)[1].strip("'") for a in args if a.startswith("hydra.run.dir=")]
            assert runs and args.count("trainer.resume=true") == len(runs) and "--multirun" not in args, args
            dirs[script.name] = os.path.commonpath(runs)
            continue
        found = [a.split("=", 1)[1] for a in args if a.startswith("hydra.sweep.dir=")]
        assert found, (script, args)
        dirs[script.name] = os.path.commonpath(found)
        assert args.count("trainer.resume=true") == args.count("--multirun") == len(found), (script, args)
        if script.name == "fog8b.sh":  # does not fit one GPU: sharded over several nodes
            assert "+sweep=fog8b" in args and "hydra.launcher.nodes=4" in args, args
            cfg = compose("+experiment=reuse_rounded", "+sweep=fog8b")
            assert (cfg.model.name, cfg.trainer.parallel, cfg.backend.name) == ("fog_8b", "fsdp", "te")
    assert "fog8b.sh" in dirs and len(dirs) >= 5 and len(set(dirs.values())) == len(dirs), dirs
    for a, b in itertools.permutations(dirs.values(), 2):
        assert not Path(a).is_relative_to(b), dirs  # no sweep writes inside another's folder


def _missing() -> list[str]:
    path = os.environ.get("PATH", "") + os.pathsep + SBIN
    return [name for name in COMMANDS if shutil.which(name, path=path) is None]


def _tails(directory: Path, pattern: str = "*.log", lines: int = 15) -> str:
    out = []
    for log in sorted(directory.rglob(pattern)):
        text = log.read_text(errors="replace").splitlines()[-lines:]
        out.append(f"--- {log}\n" + "\n".join(text))
    return "\n".join(out)


@pytest.fixture(scope="module")
def slurm_env():
    """A running single-node cluster; yields the environment for its client commands."""
    missing = _missing()
    if missing:
        reason = f"Slurm is not installed (missing: {', '.join(missing)}; Debian: slurmctld slurmd slurm-client munge)"
        if os.environ.get("READBACK_REQUIRE_SLURM") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    # A short path: the munge socket's name must fit a Unix socket address (108 bytes).
    cluster = Path(tempfile.mkdtemp(prefix="readback-slurm-", dir="/tmp" if os.path.isdir("/tmp") else None))
    env = dict(os.environ)
    env["PATH"] = f"{SCRIPTS / 'bin'}{os.pathsep}{env.get('PATH', '')}{os.pathsep}{SBIN}"
    env["SLURM_CONF"] = str(cluster / "etc" / "slurm.conf")
    # Two jobs of TASKS ranks at once, however few CPUs this machine has; one thread per rank.
    cpus = max(len(EXPERIMENTS) * TASKS, os.cpu_count() or 1)
    failed = True
    try:
        start = subprocess.run(
            ["bash", str(SCRIPTS / "start.sh"), str(cluster), str(cpus)],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        if start.returncode != 0:
            pytest.fail(f"the Slurm test cluster did not start:\n{start.stdout}\n{start.stderr}")
        yield env
        failed = False
    finally:
        subprocess.run(["bash", str(SCRIPTS / "stop.sh"), str(cluster)], env=env, timeout=60, check=False)
        if failed:
            print(_tails(cluster / "log"), file=sys.stderr)
        shutil.rmtree(cluster, ignore_errors=True)


def _scontrol(env: dict, *args: str) -> None:
    subprocess.run(["scontrol", *args], env=env, check=True, timeout=20, capture_output=True)


def _preempt_after_first_checkpoint(sweep: Path, run_dir: Path, env: dict, events: dict) -> None:
    """Signal job 0 like a preemption once it has a checkpoint; then let its requeue start now."""
    deadline = time.monotonic() + SWEEP_TIMEOUT_S
    job_id = None
    while time.monotonic() < deadline and not events["stop"].is_set():
        if job_id is None:
            found = [m.group(1) for p in sweep.glob(".submitit/*_0") if (m := re.fullmatch(r"(\d+)_0", p.name))]
            job_id = f"{found[0]}_0" if found else None
        if job_id and list_checkpoints(run_dir / "checkpoints"):
            break
        time.sleep(0.05)
    else:
        return
    # submitit's own preemption test: USR2 to the job's tasks (Slurm's --signal before the limit)
    subprocess.run(["scancel", "--signal=USR2", job_id], env=env, check=True, timeout=20)
    events["signalled"] = job_id
    # Slurm holds a requeued job back for ~2 minutes (BeginTime); release it soon after it waits.
    # Not at once: slurmd revokes the killed run's credential with one-second resolution, and
    # kills a relaunch whose new credential dates from that same second ("Job credential revoked").
    while time.monotonic() < deadline and not events["stop"].is_set():
        state = subprocess.run(
            ["scontrol", "-o", "show", "job", job_id], env=env, capture_output=True, text=True, timeout=20
        ).stdout
        if "JobState=PENDING" in state and "Restarts=0" not in state:
            time.sleep(CREDENTIAL_REVOKE_S)
            _scontrol(env, "update", f"JobId={job_id}", "StartTime=now")
            events["released"] = True
            return
        time.sleep(0.2)


@pytest.mark.slow
def test_sweep_on_slurm_fsdp_and_requeue_resume(slurm_env, tmp_path):
    sweep = tmp_path / "multirun"
    env = dict(slurm_env, WANDB_MODE="disabled", OMP_NUM_THREADS="1", HYDRA_FULL_ERROR="1")
    cmd = [
        sys.executable,
        "train.py",
        "-m",
        "hydra/launcher=slurm",
        f"+experiment={','.join(EXPERIMENTS)}",
        "seed=0",
        "model=tiny",
        "data=synthetic",
        "logger=none",
        f"trainer.steps={STEPS}",
        f"trainer.ckpt_every={CKPT_EVERY}",
        "trainer.log_every=2",
        "trainer.eval_batches=2",
        "trainer.progress=false",
        "trainer.resume=true",
        "trainer.parallel=fsdp",
        f"hydra.sweep.dir={sweep}",
        "hydra.launcher.partition=debug",
        "hydra.launcher.gpus_per_node=null",
        f"hydra.launcher.tasks_per_node={TASKS}",
        "hydra.launcher.cpus_per_task=1",
        "hydra.launcher.mem_gb=null",
        "hydra.launcher.timeout_min=10",
        "hydra.launcher.signal_delay_s=30",
    ]
    # a run's folder is named by its overrides (conf/train.yaml: hydra.job.override_dirname, sorted,
    # without the experiment, logger and resume/progress keys)
    named = sorted(
        a
        for a in cmd[3:]
        if "=" in a and not a.startswith(("hydra", "+experiment", "logger", "trainer.resume", "trainer.progress"))
    )
    subdir = ",".join(named)
    first_run = sweep / EXPERIMENTS[0] / subdir
    events: dict = {"stop": threading.Event()}
    watcher = threading.Thread(
        target=_preempt_after_first_checkpoint, args=(sweep, first_run, env, events), daemon=True
    )
    watcher.start()
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=SWEEP_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the sweep did not finish in {SWEEP_TIMEOUT_S} s\n{e.stderr}\n{_tails(sweep, '*_log.*')}")
    finally:
        events["stop"].set()
        watcher.join(timeout=30)
    job_logs = _tails(sweep, "*_log.*", 30)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}\n{job_logs}"

    for experiment in EXPERIMENTS:
        run_dir = sweep / experiment / subdir
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["status"] == "completed", (summary, job_logs)
        assert summary["steps"] == STEPS
        assert summary["experiment"] == experiment
        assert summary["world_size"] == TASKS  # torch.distributed from the Slurm environment
        steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert steps == sorted(set(steps)) and steps[-1] == STEPS  # a resume leaves no duplicates

    # Job 0 was preempted after a checkpoint, requeued by submitit, and resumed from it.
    assert events.get("signalled"), f"job 0 was never preempted\n{job_logs}"
    log0 = "\n".join(p.read_text() for p in sweep.glob(f".submitit/{events['signalled']}/*_0_log.out"))
    assert "Requeued job" in log0, job_logs
    assert re.search(r"resumed from \S+step_\d+ \(step [1-9]\d*\)", log0), log0


@pytest.mark.parametrize("submitit_job", [True, False])
def test_a_multi_node_task_takes_rank_world_and_master_from_slurm(monkeypatch, submitit_job):
    """Task 9 of a 2-node, 8-tasks-per-node job, started by submitit or by a plain ``srun``:
    global rank 9 of 16, local rank 1, and the job's first node as master (every task agrees)."""
    from readback.train.distributed import first_host, world_from_env

    for key in (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "SUBMITIT_EXECUTOR",
        "CUDA_VISIBLE_DEVICES",
    ):
        monkeypatch.setenv(key, "")  # recorded, so what the export sets is undone after the test
        monkeypatch.delenv(key)
    slurm = {
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "gpu[07-08]",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_NTASKS": "16",
        "SLURM_PROCID": "9",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "1",
    }
    if submitit_job:
        slurm["SUBMITIT_EXECUTOR"] = "slurm"
    for key, value in slurm.items():
        monkeypatch.setenv(key, value)
    assert world_from_env() == (9, 16, 1)
    assert os.environ["MASTER_ADDR"] == "gpu07" and os.environ["LOCAL_WORLD_SIZE"] == "8"
    port = os.environ["MASTER_PORT"]
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key)
    for key in ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID"):
        monkeypatch.setenv(key, "0")
    assert world_from_env() == (0, 16, 0) and os.environ["MASTER_PORT"] == port  # the same port on every node
    assert first_host("node1") == "node1" and first_host("a[003-009,12],b7") == "a003"


@pytest.mark.slow
def test_sweep_on_slurm_runs_every_job_in_the_apptainer_image(slurm_env, tmp_path):
    """``hydra/launcher=slurm_apptainer``: each job's srun runs ``apptainer exec --nv IMAGE`` with
    the image's python on this checkout's src/ (a stand-in apptainer records its call and runs
    the command as is), and the run completes."""
    bin_dir, calls, image, sweep = tmp_path / "bin", tmp_path / "apptainer_calls", tmp_path / "r.sif", tmp_path / "m"
    bin_dir.mkdir()
    image.write_text("")
    fakes = {
        "apptainer": f'echo "$*" >> {calls}\n[ "$1 $2 $3" = "exec --nv {image}" ] || exit 64\nshift 3\nexec "$@"\n',
        "python": f'exec {sys.executable} "$@"\n',
    }  # the image's python
    for name, body in fakes.items():
        (bin_dir / name).write_text("#!/usr/bin/env bash\n" + body)
        (bin_dir / name).chmod(0o755)
    env = dict(
        slurm_env,
        PATH=f"{bin_dir}{os.pathsep}{slurm_env['PATH']}",
        READBACK_IMAGE=str(image),
        WANDB_MODE="disabled",
        OMP_NUM_THREADS="1",
        HYDRA_FULL_ERROR="1",
    )
    cmd = [
        sys.executable,
        "train.py",
        "-m",
        "hydra/launcher=slurm_apptainer",
        "+experiment=reuse_rounded",
        "seed=0",
        "model=tiny",
        "data=synthetic",
        "logger=none",
        "trainer.steps=4",
        "trainer.log_every=2",
        "trainer.progress=false",
        f"hydra.sweep.dir={sweep}",
        "hydra.launcher.partition=debug",
        "hydra.launcher.gpus_per_node=null",
        "hydra.launcher.tasks_per_node=1",
        "hydra.launcher.cpus_per_task=1",
        "hydra.launcher.mem_gb=null",
        "hydra.launcher.timeout_min=5",
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=SWEEP_TIMEOUT_S)
    job_logs = _tails(sweep, "*_log.*", 30)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}\n{job_logs}"
    (summary_file,) = sweep.glob("reuse_rounded/*/summary.json")  # the run's folder is named by its overrides
    summary = json.loads(summary_file.read_text())
    assert summary["status"] == "completed" and summary["steps"] == 4, job_logs
    (call,) = calls.read_text().splitlines()
    assert call.startswith(f"exec --nv {image} env PYTHONPATH={REPO}/src python -u -m submitit.core._submit ")
