"""Who a run is, for wandb and for ``launch.json``: its name, group and tags from the config,
and where it came from (Hydra overrides, sweep directory, Slurm job, host and devices, the commit
of readback's code).

* ``group`` = ``<sweep>/<experiment>`` plus the swept overrides other than the seed, so one
  group is the seeds of one configuration (wandb's grouped curves are then mean-over-seeds);
* ``name`` = the group's experiment and swept overrides, then ``s<seed>``;
* ``job_type`` = ``train``; ``tags``: the study's axes (``policy=...``, ``rounding=...``) and the
  swept overrides, plus ``logger.tags``;
* ``config`` = the resolved run config plus ``launch``: the job's overrides, the sweep's
  command-line overrides, sweep and run directory, job number, Slurm job id, host, code.
"""

from __future__ import annotations

import os
import platform
import socket
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from readback.overrides import STUDY_AXES, config_value, is_setting, override_map, swept_keys
from readback.train.distributed import slurm_job_id

_MAX_TAG = 64  # wandb rejects longer tags
PACKAGE = Path(__file__).resolve().parents[2]  # readback's own folder, whose commit a run records


@dataclass
class RunIdentity:
    """What wandb is told about a run besides its metrics."""

    name: str
    group: str
    job_type: str
    tags: list[str] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)


def launch_context(run_dir: Path) -> dict[str, Any]:
    """Where the run came from: Hydra's overrides and directories, Slurm's job id, the host."""
    ctx: dict[str, Any] = {
        "run_dir": str(run_dir),
        "overrides": [],
        "sweep_overrides": [],
        "sweep_dir": None,
        "sweep": None,
        "job_num": None,
        "override_dirname": None,
        "slurm_job_id": slurm_job_id(),
        "host": socket.gethostname(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "argv": list(sys.argv),
        "code": code_version(),
        **_devices(),
    }
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode
    except ImportError:
        return ctx
    if not HydraConfig.initialized():
        return ctx
    hc = HydraConfig.get()
    ctx["overrides"] = list(hc.overrides.task)
    ctx["override_dirname"] = str(hc.job.override_dirname)
    if hc.mode == RunMode.MULTIRUN:
        sweep_dir = Path(str(hc.sweep.dir))
        ctx.update(
            sweep_dir=str(sweep_dir),
            sweep=sweep_dir.name,
            job_num=int(hc.job.num),
            sweep_overrides=sweep_overrides(sweep_dir, ctx["overrides"]),
        )
    return ctx


def _devices() -> dict[str, Any]:
    import torch

    gpus = (
        [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    )
    # The CPU's model and the vector unit torch's kernels dispatch to: runs on CPUs that differ in
    # either need not agree bit for bit (their float reductions run in other orders).
    return {
        "torch": torch.__version__,
        "gpus": gpus,
        "cpu_model": cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }


def cpu_kind() -> str:
    """The CPU's model and the vector unit torch dispatches to, in one line (``AMD EPYC, AVX512``),
    as the analysis names a run's kind from ``launch.json``."""
    import torch

    return f"{cpu_model()}, {torch.backends.cpu.get_cpu_capability()}"


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model name (Linux's ``/proc/cpuinfo``), else the platform's word for it."""
    if cpuinfo.is_file():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                return value.strip()
    return platform.processor()


def code_version(package: Path = PACKAGE) -> dict[str, Any]:
    """The git commit readback's code was checked out at, and whether its tracked files differ from
    that commit: what "all arms ran on one code version" is checked against. Both are None when the
    package is not a tracked file of a git work tree (an installed copy) or git cannot be run."""

    def git(*args: str) -> str:
        cmd = ["git", "--no-optional-locks", "-C", str(package), *args]  # no index lock: jobs run side by side
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True).stdout.strip()

    try:
        git("ls-files", "--error-unmatch", "__init__.py")
        return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


def sweep_overrides(sweep_dir: Path, job_overrides: list[str], argv: list[str] | None = None) -> list[str]:
    """The command-line overrides of the sweep that made this job (``seed=0,1,2``): the process's
    own command line where it is the sweep's (Hydra's basic launcher runs the jobs in the process
    that parsed it), else the ``multirun.yaml`` Hydra writes into the sweep directory. Either counts
    only if it expands to ``job_overrides``: two sweeps launched into one directory (one stream of
    seeds a core) overwrite each other's ``multirun.yaml``, and a job must not record the other's.
    [] when neither does."""
    for candidate in (_argv_overrides(sys.argv if argv is None else argv), _multirun_yaml_overrides(sweep_dir)):
        if candidate and list(job_overrides) in _expansions(candidate):
            return candidate
    return []


def _argv_overrides(argv: list[str]) -> list[str]:
    """The overrides a command line gives Hydra (its flags and their values left out)."""
    from hydra._internal.utils import get_args_parser

    try:
        args, _ = get_args_parser().parse_known_args(argv[1:])
    except SystemExit:  # argparse's way of refusing a command line
        return []
    # Hydra's own settings (hydra.sweep.dir=...) are not the task's: multirun.yaml lists them apart
    return [str(o) for o in args.overrides or [] if not str(o).lstrip("+~").startswith(("hydra.", "hydra/"))]


def _multirun_yaml_overrides(sweep_dir: Path) -> list[str]:
    path = Path(sweep_dir) / "multirun.yaml"
    if not path.is_file():
        return []
    import yaml

    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (yaml.YAMLError, OSError):
        return []
    return [str(o) for o in (((doc.get("hydra") or {}).get("overrides") or {}).get("task") or [])]


def _expansions(overrides: list[str]) -> list[list[str]]:
    """The jobs' overrides a sweep's overrides expand to, as Hydra's basic sweeper expands them."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception:
        return []
    return [list(job) for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]


def run_identity(
    config: Mapping[str, Any],
    launch: Mapping[str, Any],
    *,
    user_tags: list[str] | None = None,
    group: str | None = None,
    job_type: str,
) -> RunIdentity:
    """Name, group and tags of a run from its config and :func:`launch_context`."""
    experiment = str(config.get("experiment") or "custom")
    seed = config.get("seed")
    values = override_map(launch.get("overrides"))
    axes = [k for k in swept_keys(launch.get("sweep_overrides") or []) if is_setting(k)]
    swept = [f"{k}={values[k]}" for k in axes if k in values]
    label = " ".join([experiment, *swept])
    sweep = launch.get("sweep")
    study = {axis: _dotted(config, key) for axis, key in STUDY_AXES.items()}
    tags = [experiment] + [f"{tag}={v}" for tag, v in study.items() if v is not None]
    tags += swept + ([f"sweep={sweep}"] if sweep else []) + [str(t) for t in user_tags or []]
    return RunIdentity(
        name=f"{label} s{seed}" if seed is not None else label,
        group=group or (f"{sweep}/{label}" if sweep else label),
        job_type=job_type,
        tags=list(dict.fromkeys(t[:_MAX_TAG] for t in tags)),
        config={**config, "launch": dict(launch)},
    )


def _dotted(cfg: Mapping[str, Any], dotted: str) -> Any:
    """A scalar config value for a tag, or None."""
    value = config_value(cfg, dotted)
    return value if isinstance(value, (str, int, float, bool)) else None
