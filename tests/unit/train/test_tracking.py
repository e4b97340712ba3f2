"""Run identity from the launch overrides (wandb's name, group and tags), the Slurm job id, and
``readback.sync`` on a directory without offline runs; wandb on a real sweep is in
tests/integration/test_tracking.py."""

import shutil
import subprocess

import pytest

from readback.overrides import swept_keys
from readback.train.records.identity import run_identity


def test_identity_from_overrides():
    launch = {
        "overrides": ["+experiment=reuse_rounded", "seed=2", "trainer.optim.lr=0.03", "model=tiny"],
        "sweep_overrides": [
            "+experiment=reuse_rounded,no_saved_copy",
            "seed=0,1,2",
            "trainer.optim.lr=0.001,0.03",
            "model=tiny",
            "trainer.resume=true",
        ],
        "sweep": "lr_study",
    }
    cfg = {
        "experiment": "reuse_rounded",
        "seed": 2,
        "policy": {"name": "reuse_rounded"},
        "precision": {"name": "fp8", "rounding": "nearest"},
    }
    ident = run_identity(cfg, launch, user_tags=["mine"], job_type="train")
    assert ident.name == "reuse_rounded trainer.optim.lr=0.03 s2"
    assert ident.group == "lr_study/reuse_rounded trainer.optim.lr=0.03"
    assert ident.job_type == "train"
    assert ident.tags == [
        "reuse_rounded",
        "precision=fp8",
        "rounding=nearest",
        "policy=reuse_rounded",
        "trainer.optim.lr=0.03",
        "sweep=lr_study",
        "mine",
    ]
    assert ident.config["launch"] is not launch and ident.config["launch"]["overrides"] == launch["overrides"]
    assert swept_keys(["seed=range(3)", "a=1", "b=x,y", "+experiment=glob(*)"]) == ["seed", "b", "experiment"]
    single = run_identity(
        {"experiment": "custom", "seed": 0}, {"overrides": [], "sweep_overrides": []}, job_type="eval"
    )
    assert (single.name, single.group, single.job_type) == ("custom s0", "custom", "eval")


def test_sync_refuses_a_directory_without_offline_runs(tmp_path, capsys):
    from readback.cli.sync import main

    assert main([str(tmp_path)]) == 2
    assert "no offline wandb runs" in capsys.readouterr().err
    assert main([str(tmp_path / "missing")]) == 2


def test_slurm_job_id_names_the_array_task(monkeypatch):
    from readback.train.distributed import slurm_job_id

    for key in ("SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID"):
        monkeypatch.delenv(key, raising=False)
    assert slurm_job_id() is None
    monkeypatch.setenv("SLURM_JOB_ID", "4711")
    assert slurm_job_id() == "4711"
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "4700")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "11")
    assert slurm_job_id() == "4700_11"


def test_launch_records_the_cpu_that_ran_the_run(tmp_path):
    """A CPU run reproduces bit for bit only on a CPU whose kernels add in the same order."""
    import torch

    from readback.train.records.identity import cpu_model, launch_context

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 9999 64-Core\n")
    assert cpu_model(cpuinfo) == "AMD EPYC 9999 64-Core"
    ctx = launch_context(tmp_path)
    assert ctx["cpu_capability"] == torch.backends.cpu.get_cpu_capability() and isinstance(ctx["cpu_model"], str)


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_launch_records_the_commit_the_code_was_at(tmp_path):
    """The code version is what "all arms ran on one code version" is checked against."""
    from readback.train.records.identity import code_version, launch_context

    def git(*args):
        return subprocess.run(["git", "-C", str(tmp_path), *args], capture_output=True, text=True, check=True).stdout

    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("x = 1\n")
    assert code_version(package) == {"commit": None, "dirty": None}  # not a work tree
    git("init", "-q")
    assert code_version(package) == {"commit": None, "dirty": None}  # a work tree, the package not in it
    git("add", "pkg/__init__.py")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one")
    (tmp_path / "untracked.txt").write_text("run output\n")
    assert code_version(package) == {"commit": git("rev-parse", "HEAD").strip(), "dirty": False}
    (package / "__init__.py").write_text("x = 2\n")
    assert code_version(package)["dirty"] is True
    assert launch_context(tmp_path)["code"] == code_version()  # readback's own checkout
