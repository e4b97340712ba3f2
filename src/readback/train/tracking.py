"""Weights & Biases run set-up: who a run is (name, group, tags), where it came from (Hydra
overrides, sweep directory, Slurm job), and a wrapper that never stops training.

* ``group`` = ``<sweep>/<experiment>`` plus the swept overrides other than the seed, so one
  group is the seeds of one configuration (wandb's grouped curves are then mean-over-seeds);
* ``name`` = the group's experiment and swept overrides, then ``s<seed>``;
* ``job_type`` = ``train``; ``tags``: the study's axes (``policy=...``, ``rounding=...``) and the
  swept overrides, plus ``logger.tags``;
* ``config`` = the resolved run config plus ``launch``: the job's overrides, the sweep's
  command-line overrides, sweep and run directory, job number, Slurm job id, host;
* curves are plotted against ``tokens`` (``define_metric``) and the summary keeps the last and
  the minimum of ``loss``.

A requeued job resumes the run id stored in its checkpoint (``resume="allow"``): online it is
one run; offline each start writes another ``wandb/offline-run-<time>-<id>`` folder, and
``python -m readback.sync`` uploads them in start order into that one run.
"""

from __future__ import annotations

import contextlib
import logging
import netrc
import os
import platform
import secrets
import socket
import string
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, cast
from urllib.parse import urlparse

from readback.overrides import config_value, is_setting, override_map, swept_keys

log = logging.getLogger(__name__)

#: The study's axes, as tags: tag name -> dotted config key.
TAG_AXES = {
    "model": "model.name",
    "precision": "precision.name",
    "rounding": "precision.rounding",
    "policy": "policy.name",
    "bwd": "attention.bwd_precision",
}
#: The x axis of every curve, and the keys plotted against it (globs).
STEP_METRIC = "tokens"
TOKEN_AXIS_KEYS = (
    "loss",
    "val_loss",
    "lr",
    "grad_norm",
    "tokens_per_s",
    "grad_error/*",
    "grad_error_se/*",
    "attn_rowsum/*",
    "kurtosis/*",
    "fp8_saturation/*",
    "fp8_underflow/*",
    "grad_bias/*",
)
#: Keys whose summary keeps both the last and the smallest value (val_loss: the summary.json value).
MIN_LAST_KEYS = ("loss",)
_MAX_TAG = 64  # wandb rejects longer tags


# ---------------------------------------------------------------------------------------------
# who the run is


@dataclass
class RunIdentity:
    """What wandb is told about a run besides its metrics."""

    name: str
    group: str
    job_type: str = "train"
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
            sweep_overrides=sweep_overrides(sweep_dir),
        )
    return ctx


def _devices() -> dict[str, Any]:
    import torch

    gpus = (
        [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    )
    return {"torch": torch.__version__, "gpus": gpus}


def slurm_job_id() -> str | None:
    """``<array job>_<task>`` for an array job, else ``SLURM_JOB_ID`` (None outside Slurm)."""
    array, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    if array and task:
        return f"{array}_{task}"
    return os.environ.get("SLURM_JOB_ID")


def sweep_overrides(sweep_dir: Path) -> list[str]:
    """The sweep's command-line overrides as typed (``seed=0,1,2``), from the ``multirun.yaml``
    Hydra writes into the sweep directory before it starts the jobs; [] when it is absent."""
    path = Path(sweep_dir) / "multirun.yaml"
    if not path.is_file():
        return []
    import yaml

    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (yaml.YAMLError, OSError):
        return []
    return [str(o) for o in (((doc.get("hydra") or {}).get("overrides") or {}).get("task") or [])]


def run_identity(
    config: Mapping[str, Any],
    launch: Mapping[str, Any],
    *,
    user_tags: list[str] | None = None,
    group: str | None = None,
    job_type: str = "train",
) -> RunIdentity:
    """Name, group and tags of a run from its config and :func:`launch_context`."""
    experiment = str(config.get("experiment") or "custom")
    seed = config.get("seed")
    values = override_map(launch.get("overrides"))
    axes = [k for k in swept_keys(launch.get("sweep_overrides") or []) if is_setting(k)]
    swept = [f"{k}={values[k]}" for k in axes if k in values]
    label = " ".join([experiment, *swept])
    sweep = launch.get("sweep")
    tags = [experiment] + [f"{tag}={v}" for tag, key in TAG_AXES.items() if (v := _dotted(config, key)) is not None]
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


def define_metrics(run: Any) -> None:
    """Curves against ``tokens``; last and min of the losses in the summary."""
    run.define_metric(STEP_METRIC)
    for key in TOKEN_AXIS_KEYS:
        run.define_metric(key, step_metric=STEP_METRIC, summary="min,last" if key in MIN_LAST_KEYS else None)


# ---------------------------------------------------------------------------------------------
# the run, best effort


def _have_wandb_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or ""
    for candidate in (os.environ.get("NETRC"), "~/.netrc", "~/_netrc"):
        if not candidate:
            continue
        path = Path(candidate).expanduser()
        try:
            if path.is_file() and netrc.netrc(str(path)).authenticators(host):
                return True
        except (OSError, netrc.NetrcParseError):
            continue
    return False


def resolve_wandb_mode(mode: str | None) -> str:
    """``online`` | ``offline`` | ``disabled``: ``WANDB_MODE``/``WANDB_DISABLED`` win, then the config;
    ``auto`` is online when an API key is configured, else offline."""
    if os.environ.get("WANDB_DISABLED", "").lower() in ("1", "true", "yes"):
        return "disabled"
    env = os.environ.get("WANDB_MODE", "").strip().lower()
    chosen = env or (mode or "auto").lower()
    if chosen == "dryrun":
        chosen = "offline"
    if chosen == "auto":
        chosen = "online" if _have_wandb_key() else "offline"
    if chosen not in ("online", "offline", "disabled"):
        log.warning("unknown wandb mode %r; using offline", chosen)
        chosen = "offline"
    return chosen


def new_wandb_run_id() -> str:
    alphabet = string.ascii_lowercase + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(8))


class WandbLogger:
    """Best-effort wandb run. ``self.mode`` ends up ``online``, ``offline`` or ``noop``: the
    requested mode is tried, then offline into the run directory, then nothing; the first
    failing ``log`` disables it."""

    def __init__(
        self,
        *,
        run_dir: Path,
        identity: RunIdentity,
        project: str = "readback",
        entity: str | None = None,
        mode: str = "auto",
        run_id: str | None = None,
        init_timeout: float = 60.0,
    ):
        self.run_id = run_id or new_wandb_run_id()
        self.mode = "noop"
        self._run = None
        self._warned = False
        wanted = resolve_wandb_mode(mode)
        if wanted == "disabled":
            return
        try:
            import wandb
        except Exception as e:
            log.warning("wandb unavailable (%s); metrics go to metrics.jsonl only", e)
            return
        for attempt in [wanted] + (["offline"] if wanted == "online" else []):
            try:
                self._run = wandb.init(
                    project=project,
                    entity=entity,
                    name=identity.name,
                    group=identity.group,
                    job_type=identity.job_type,
                    tags=list(identity.tags),
                    config=identity.config,
                    dir=str(run_dir),
                    id=self.run_id,
                    resume="allow",
                    mode=cast(Literal["online", "offline", "disabled"], attempt),  # resolve_wandb_mode's
                    settings=wandb.Settings(init_timeout=float(init_timeout), silent=True),
                )
                self.mode = attempt
                break
            except Exception as e:
                log.warning("wandb.init in %s mode failed (%s: %s)", attempt, type(e).__name__, e)
                self._run = None
                # a failed init keeps the run id taken in this process: release it for the next try
                with contextlib.suppress(Exception):
                    wandb.teardown()
        if self._run is None:
            log.warning("wandb disabled for this run; metrics go to metrics.jsonl only")
            return
        try:
            define_metrics(self._run)
        except Exception as e:
            log.warning("wandb define_metric failed (%s: %s)", type(e).__name__, e)

    def log(self, record: Mapping[str, Any], step: int) -> None:
        if self._run is None:
            return
        try:
            self._run.log({k: v for k, v in record.items() if k != "step"}, step=int(step))
        except Exception as e:
            self._fail("log", e)

    def summary(self, values: Mapping[str, Any]) -> None:
        if self._run is None:
            return
        try:
            for k, v in values.items():
                self._run.summary[k] = v
        except Exception as e:
            self._fail("summary", e)

    def mark_preempting(self) -> None:
        """Tell wandb the run stops for a preemption (it is resumed later under the same id)."""
        if self._run is None:
            return
        try:
            self._run.mark_preempting()
        except Exception as e:
            log.debug("wandb mark_preempting failed: %s", e)

    def _fail(self, what: str, e: Exception) -> None:
        if not self._warned:
            log.warning("wandb %s failed (%s: %s); wandb disabled, metrics.jsonl continues", what, type(e).__name__, e)
            self._warned = True
        self.finish(exit_code=1)

    def finish(self, exit_code: int = 0) -> None:
        run, self._run = self._run, None
        if run is None:
            return
        try:
            run.finish(exit_code=exit_code)
        except Exception as e:
            log.warning("wandb finish failed (%s: %s)", type(e).__name__, e)
